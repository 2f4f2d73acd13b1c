"""Concurrent app transactions for the end-to-end tests, recorded in tests.support.ledger's tables.

Each transaction stages one job for ``tests.support.tasks.record`` and, as its last statement
before COMMIT, writes the job's ledger row (so the ledger is exactly the committed set); after the
COMMIT returned it writes the ``committed`` row. A fraction roll back; a fraction is held open a
little before committing, so later row ids often commit before earlier ones.
(The fault suite's own helpers live in tests.support.faultload.)
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Any

import psycopg

import drain
from tests.support import ledger

JOB_NAME = "tests.support.tasks.record"


class Load:
    """``count`` transactions over ``threads`` connections; ``start().join()`` returns self."""

    def __init__(
        self,
        dsn: str,
        count: int,
        *,
        threads: int = 4,
        queue: str = "default",
        rollback_fraction: float = 0.3,
        hold_fraction: float = 0.05,
        hold_s: float = 0.05,
        seed: int = 1,
    ) -> None:
        self.dsn = dsn
        self.count = count
        self.queue = queue
        self.rollback_fraction = rollback_fraction
        self.hold_fraction = hold_fraction
        self.hold_s = hold_s
        self.committed: set[uuid.UUID] = set()
        self.rolled_back: set[uuid.UUID] = set()
        self.transactions = 0
        self.held = 0
        self._seed = seed
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(threads)]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def join(self, timeout_s: float = 600.0) -> Load:
        for thread in self._threads:
            thread.join(timeout_s)
        return self

    def _take(self) -> int | None:
        with self._lock:
            if self.transactions >= self.count:
                return None
            self.transactions += 1
            return self.transactions

    def _run(self, index: int) -> None:
        rng = random.Random(self._seed * 1000 + index)
        with psycopg.connect(self.dsn) as conn:
            while (number := self._take()) is not None:
                self._one(conn, rng, number)

    def _one(self, conn: psycopg.Connection[Any], rng: random.Random, number: int) -> None:
        txn = ledger.new_txn()
        with conn.cursor() as cursor:
            job_id = drain.stage(cursor, JOB_NAME, args=[number], queue=self.queue)
            row = cursor.execute("SELECT max(id) FROM staged_jobs WHERE job_id = %s", (job_id,)).fetchone()
            if rng.random() < self.rollback_fraction:
                conn.rollback()
                with self._lock:
                    self.rolled_back.add(job_id)
                return
            if rng.random() < self.hold_fraction:
                with self._lock:
                    self.held += 1
                time.sleep(self.hold_s)
            cursor.execute(
                "INSERT INTO ledger (job_id, txn, pre_commit_at) VALUES (%s, %s, clock_timestamp())",
                (job_id, txn),
            )
        conn.commit()
        with self._lock:
            self.committed.add(job_id)
        conn.execute(
            "INSERT INTO committed (txn, max_row_id, committed_at) VALUES (%s, %s, clock_timestamp())",
            (txn, row[0] if row else 0),
        )
        conn.commit()
