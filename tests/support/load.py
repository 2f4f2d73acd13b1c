"""Stage jobs from several connections at once, the way an app does: in its own transactions.

Each transaction stages 1..max_per_txn ``tests.support.tasks.record`` jobs (with ``drain.stage``
or ``drain.stage_many``), writes their ``ledger`` rows as its last statement (stamped with the
database clock), then commits, or rolls back (``rollback_fraction`` of them). Some transactions
are held open for a while after staging, so later ids commit first. After a commit the thread
records the transaction in ``committed`` with the clock and its largest row id.
(The fault suite's own helpers live in tests.support.faultload.)
"""

from __future__ import annotations

import dataclasses
import random
import threading
import uuid
from typing import Any

import psycopg

import drain

JOB_NAME = "tests.support.tasks.record"


@dataclasses.dataclass
class LoadResult:
    committed: set[uuid.UUID] = dataclasses.field(default_factory=set)
    rolled_back: set[uuid.UUID] = dataclasses.field(default_factory=set)
    transactions: int = 0
    held: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


class Load:
    """Stage ``total_jobs`` from ``threads`` connections; ``stop`` ends it early."""

    def __init__(
        self,
        dsn: str,
        total_jobs: int,
        *,
        threads: int = 4,
        max_per_txn: int = 10,
        rollback_fraction: float = 1 / 3,
        hold_fraction: float = 0.1,
        hold_s: tuple[float, float] = (0.05, 0.4),
        pace_s: float = 0.0,
        seed: int | None = None,
        queue: str = "default",
        autocommit: bool = False,
    ) -> None:
        self.dsn = dsn
        self.queue = queue
        self.autocommit = autocommit  # a broken app: each statement commits on its own
        self.total_jobs = total_jobs
        self.max_per_txn = max_per_txn
        self.rollback_fraction = rollback_fraction
        self.hold_fraction = hold_fraction
        self.hold_s = hold_s
        self.pace_s = pace_s
        self.stop = threading.Event()
        self.result = LoadResult()
        self._lock = threading.Lock()
        self._budget = total_jobs
        self._seed = random.randrange(1 << 30) if seed is None else seed
        self._threads = [
            threading.Thread(target=self._work, args=(index,), name=f"stager-{index}", daemon=True)
            for index in range(threads)
        ]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def join(self, timeout_s: float = 300.0) -> LoadResult:
        for thread in self._threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), "a staging thread did not finish"
        assert not self.result.errors, self.result.errors[:3]
        return self.result

    def _take(self, wanted: int) -> int:
        with self._lock:
            granted = min(wanted, self._budget)
            self._budget -= granted
            return granted

    def _work(self, index: int) -> None:
        rng = random.Random(self._seed + index)
        try:
            with psycopg.connect(self.dsn, autocommit=self.autocommit) as conn:
                while not self.stop.is_set():
                    count = self._take(rng.randint(1, self.max_per_txn))
                    if not count:
                        return
                    self._transaction(conn, rng, count)
                    if self.pace_s:
                        self.stop.wait(self.pace_s * rng.random() * 2)
        except Exception as exc:
            with self._lock:
                self.result.errors.append(f"{type(exc).__name__}: {exc}")

    def _transaction(self, conn: psycopg.Connection[Any], rng: random.Random, count: int) -> None:
        txn = uuid.uuid4().hex
        ids: list[uuid.UUID]
        if count == 1 or rng.random() < 0.3:
            ids = [
                drain.stage(conn, JOB_NAME, args=[txn, n], kwargs={"n": n}, queue=self.queue)
                for n in range(count)
            ]
        else:
            jobs = [
                drain.Job(JOB_NAME, args=[txn, n], kwargs={"n": n}, queue=self.queue) for n in range(count)
            ]
            ids = drain.stage_many(conn, jobs)
        row = conn.execute(
            "SELECT max(id) FROM staged_jobs WHERE job_id = ANY(%s::uuid[])", (ids,)
        ).fetchone()
        assert row is not None
        max_row_id = row[0]
        held = rng.random() < self.hold_fraction
        if held:  # other threads stage and commit later ids meanwhile
            self.stop.wait(rng.uniform(*self.hold_s))
        rollback = rng.random() < self.rollback_fraction
        # The last statement before COMMIT: its clock is a lower bound of the commit time.
        conn.execute(
            "INSERT INTO ledger (job_id, txn, pre_commit_at) "
            "SELECT unnest(%s::uuid[]), %s, clock_timestamp()",
            (ids, txn),
        )
        if rollback:
            conn.rollback()
        else:
            conn.commit()
            conn.execute("INSERT INTO committed (txn, max_row_id) VALUES (%s, %s)", (txn, max_row_id))
            conn.commit()
        with self._lock:
            self.result.transactions += 1
            self.result.held += held
            (self.result.rolled_back if rollback else self.result.committed).update(ids)
