"""The test suite's one load generator: stage jobs the way an app does, in its own transactions.

Each transaction stages ``per_transaction`` jobs (a number, or a range drawn from) with
``drain.stage`` or ``drain.stage_many``, writes their ``ledger`` rows as its last statement
(stamped with the database clock: see tests.support.ledger), then commits, or rolls back
(``rollback_fraction`` of them: their ids are remembered, to check that none is ever delivered).
Some transactions are held open for a while after staging (``hold_fraction``), so later ids commit
first. After a commit the thread records the transaction in ``committed`` with the clock and its
largest row id. The ledger, not this bookkeeping, is the committed set: a commit whose outcome
was lost with the connection is still counted right.

``reconnect=True`` survives a database that goes away (the fault suite): a failed transaction is
counted in ``result.errors`` and the thread reconnects; otherwise the first error ends the thread
and :meth:`Load.join` fails the test with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import uuid
from collections.abc import Mapping, Sequence
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
    """Stage ``jobs`` (or ``transactions``; unbounded if neither) from ``threads`` connections;
    :meth:`stop` ends it early. ``start``/``join`` run it in threads, :meth:`run` in this one."""

    def __init__(
        self,
        dsn: str,
        jobs: int | None = None,
        *,
        transactions: int | None = None,
        threads: int = 4,
        per_transaction: int | tuple[int, int] = (1, 10),
        rollback_fraction: float = 1 / 3,
        hold_fraction: float = 0.1,
        hold_s: tuple[float, float] = (0.05, 0.4),
        pace_s: float | tuple[float, float] = 0.0,
        seed: int | None = None,
        job: str = JOB_NAME,
        queue: str | None = None,
        backends: Sequence[str] = ("default",),
        queues: Mapping[str, str] | None = None,
        autocommit: bool = False,
        reconnect: bool = False,
    ) -> None:
        """``queue`` names the queue of every backend; without it each backend gets a queue of
        its own, unique to this load, unless ``queues`` names it. ``pace_s``: the pause after
        each transaction, or the range it is drawn from. ``autocommit``: a broken app, each
        statement commits on its own."""
        self.dsn = dsn
        self.job = job
        self.backends = list(backends)
        unique = uuid.uuid4().hex[:8]
        self.queues = {name: queue or f"load-{name}-{unique}" for name in self.backends}
        self.queues.update(queues or {})
        self.autocommit = autocommit
        self.reconnect = reconnect
        self.per_transaction = (
            (per_transaction, per_transaction) if isinstance(per_transaction, int) else per_transaction
        )
        self.rollback_fraction = rollback_fraction
        self.hold_fraction = hold_fraction
        self.hold_s = hold_s
        self.pace_s = pace_s
        self.halt = threading.Event()
        self.result = LoadResult()
        self._lock = threading.Lock()
        self._jobs = jobs
        self._transactions = transactions
        self._counter = 0
        self._seed = random.randrange(1 << 30) if seed is None else seed
        self._threads = [
            threading.Thread(target=self._work, args=(index,), name=f"stager-{index}", daemon=True)
            for index in range(threads)
        ]

    @property
    def rolled_back(self) -> set[uuid.UUID]:
        return self.result.rolled_back

    @property
    def most_per_transaction(self) -> int:
        return self.per_transaction[1]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def run(self) -> LoadResult:
        """Stage on one connection in this thread until the budget is spent."""
        self._work(0)
        return self._checked()

    def join(self, timeout_s: float = 300.0) -> LoadResult:
        """Wait for the budget to be spent."""
        for thread in self._threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), "a staging thread did not finish"
        return self._checked()

    def stop(self, timeout_s: float = 60.0) -> LoadResult:
        """End it early: each thread finishes its transaction."""
        self.halt.set()
        for thread in self._threads:
            if thread.is_alive() or thread.ident is not None:
                thread.join(timeout_s)
        return self.result

    def _checked(self) -> LoadResult:
        if not self.reconnect:
            assert not self.result.errors, self.result.errors[:3]
        return self.result

    def _take(self, rng: random.Random) -> int:
        """A transaction's number of jobs, from the budget (0: spent)."""
        wanted = rng.randint(*self.per_transaction)
        with self._lock:
            if self._transactions is not None:
                if self._transactions <= 0:
                    return 0
                self._transactions -= 1
            if self._jobs is None:
                return wanted
            granted = min(wanted, self._jobs)
            self._jobs -= granted
            return granted

    def _work(self, index: int) -> None:
        rng = random.Random(self._seed + index)
        conn: psycopg.Connection[Any] | None = None
        try:
            while not self.halt.is_set():
                count = self._take(rng)
                if not count:
                    return
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(self.dsn, autocommit=self.autocommit, connect_timeout=3)
                    self._transaction(conn, rng, count)
                except psycopg.Error as exc:
                    with self._lock:
                        self.result.errors.append(f"{type(exc).__name__}: {exc}")
                    if not self.reconnect:
                        return
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            conn.close()
                    conn = None
                    self.halt.wait(0.2)
                    continue
                pause_s = rng.uniform(*self.pace_s) if isinstance(self.pace_s, tuple) else self.pace_s
                if pause_s:
                    self.halt.wait(pause_s)
        except Exception as exc:
            with self._lock:
                self.result.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    def _transaction(self, conn: psycopg.Connection[Any], rng: random.Random, count: int) -> None:
        txn = uuid.uuid4().hex
        with self._lock:
            backends = []
            for _ in range(count):
                self._counter += 1
                backends.append(self.backends[self._counter % len(self.backends)])
        jobs = [
            drain.Job(self.job, args=[txn, n], kwargs={"n": n}, backend=backend, queue=self.queues[backend])
            for n, backend in enumerate(backends)
        ]
        ids: list[uuid.UUID]
        if count == 1 or rng.random() < 0.3:
            ids = [
                drain.stage(
                    conn, job.job_name, args=job.args, kwargs=job.kwargs, backend=job.backend, queue=job.queue
                )
                for job in jobs
            ]
        else:
            ids = drain.stage_many(conn, jobs)
        row = conn.execute(  # in autocommit mode the drain may have forwarded them already:
            # then the identity's last value bounds their ids
            "SELECT coalesce((SELECT max(id) FROM staged_jobs WHERE job_id = ANY(%s::uuid[])), "
            "pg_sequence_last_value(pg_get_serial_sequence('staged_jobs', 'id')))",
            (ids,),
        ).fetchone()
        assert row is not None
        max_row_id = row[0]
        held = rng.random() < self.hold_fraction
        if held:  # other threads stage and commit later ids meanwhile
            self.halt.wait(rng.uniform(*self.hold_s))
        rollback = rng.random() < self.rollback_fraction
        # The last statement before COMMIT: its clock is a lower bound of the commit time.
        conn.execute(
            "INSERT INTO ledger (job_id, txn, backend, pre_commit_at) "
            "SELECT unnest(%s::uuid[]), %s, unnest(%s::text[]), clock_timestamp()",
            (ids, txn, backends),
        )
        if rollback:
            with self._lock:
                self.result.rolled_back.update(ids)
            conn.rollback()
        else:
            conn.commit()
            with self._lock:
                self.result.committed.update(ids)
            conn.execute("INSERT INTO committed (txn, max_row_id) VALUES (%s, %s)", (txn, max_row_id))
            conn.commit()
        with self._lock:
            self.result.transactions += 1
            self.result.held += held
