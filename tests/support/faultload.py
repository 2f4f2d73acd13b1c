"""The fault suite's load generator, drain processes and delivery counting.

The load generator stages jobs in transactions that also insert one ledger row per job, so the
committed set is exactly the ledger (even when a commit's outcome was lost with the connection);
some transactions roll back on purpose, and their job ids are remembered to check that none of
them is ever delivered. An audit trigger records every committed delete from the staged-jobs table
with the deleting session's backend pid and application name, so a test can tell which drain
deleted what, and when. Deliveries are read back from Redis: the RQ job hashes and queue lists.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psycopg
import redis

import drain
from tests.support import ledger

JOB_NAME = "tests.support.faultload.noop"
DEADLINE_S = 120.0

PREPARE_SQL = """
CREATE TABLE IF NOT EXISTS fault_ledger (
    job_id uuid PRIMARY KEY,
    backend text NOT NULL,
    staged_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS fault_deletes (
    job_id uuid NOT NULL,
    pid integer NOT NULL,
    app text NOT NULL,
    at timestamptz NOT NULL
);
CREATE OR REPLACE FUNCTION fault_audit_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO fault_deletes VALUES
        (OLD.job_id, pg_backend_pid(), current_setting('application_name'), clock_timestamp());
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS fault_audit ON staged_jobs;
CREATE TRIGGER fault_audit AFTER DELETE ON staged_jobs FOR EACH ROW EXECUTE FUNCTION fault_audit_delete();
"""


def noop(*args: Any, **kwargs: Any) -> None:
    """The job every staged row names (a worker would import and run it)."""


def free_port() -> int:
    """A loopback port nothing listens on right now (also usable as a 'server down' address)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def prepare(dsn: str) -> None:
    """Create the ledger and the delete audit in a migrated test database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(PREPARE_SQL)


# --- load -------------------------------------------------------------------------------------


class LoadGenerator(threading.Thread):
    """Stage jobs in transactions with a ledger row per job; roll back a fraction of them.

    Runs until ``stop()`` or until ``transactions`` were attempted. Survives a database that goes
    away: it reconnects, and the ledger (not its own bookkeeping) says what committed.
    """

    def __init__(
        self,
        dsn: str,
        *,
        backends: Sequence[str] = ("default",),
        queues: Mapping[str, str] | None = None,
        jobs_per_transaction: int = 5,
        rollback_fraction: float = 0.2,
        transactions: int | None = None,
        pause_s: float = 0.005,
        seed: int = 4,
    ) -> None:
        super().__init__(daemon=True, name="load")
        self.dsn = dsn
        self.backends = list(backends)
        unique = uuid.uuid4().hex[:8]
        self.queues = {name: f"faults-{name}-{unique}" for name in self.backends}
        self.queues.update(queues or {})
        self.jobs_per_transaction = jobs_per_transaction
        self.rollback_fraction = rollback_fraction
        self.transactions = transactions
        self.pause_s = pause_s
        self.rolled_back: set[uuid.UUID] = set()
        self.errors = 0
        self._random = random.Random(seed)
        self._halt = threading.Event()
        self._counter = 0

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=60)

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        attempted = 0
        while not self._halt.is_set() and (self.transactions is None or attempted < self.transactions):
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, connect_timeout=3)
                attempted += 1
                self._one(conn)
            except psycopg.Error:
                self.errors += 1
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
                conn = None
                self._halt.wait(0.2)
                continue
            if self.pause_s:
                self._halt.wait(self.pause_s)
        if conn is not None:
            conn.close()

    def _one(self, conn: psycopg.Connection[Any]) -> None:
        roll_back = self._random.random() < self.rollback_fraction
        ids: list[uuid.UUID] = []
        jobs = []
        for _ in range(self.jobs_per_transaction):
            self._counter += 1
            backend = self.backends[self._counter % len(self.backends)]
            job_id = uuid.uuid4()
            ids.append(job_id)
            jobs.append(
                drain.Job(
                    JOB_NAME,
                    args=[self._counter],
                    backend=backend,
                    queue=self.queues[backend],
                    job_id=job_id,
                )
            )
        if roll_back:
            self.rolled_back.update(ids)
        with conn.cursor() as cursor:
            drain.stage_many(cursor, jobs)
            cursor.execute(
                "INSERT INTO fault_ledger (job_id, backend) SELECT * FROM unnest(%s::uuid[], %s::text[])",
                (ids, [job.backend for job in jobs]),
            )
        if roll_back:
            conn.rollback()
        else:
            conn.commit()


def stage_committed(dsn: str, **load: Any) -> LoadGenerator:
    """Run a LoadGenerator to completion in this thread (``transactions`` is required)."""
    generator = LoadGenerator(dsn, pause_s=0, **load)
    generator.run()
    return generator


# --- counting ---------------------------------------------------------------------------------


def delivered(redis_url: str, queues: Iterable[str]) -> Counter[uuid.UUID]:
    """How many times each job id was enqueued on these RQ queues.

    Only the test's own uniquely named queues are read: a Redis db index may hold other keys.
    """
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        listed: Counter[uuid.UUID] = Counter()
        for queue in set(queues):
            listed.update(uuid.UUID(job_id.decode()) for job_id in client.lrange(f"rq:queue:{queue}", 0, -1))
        return listed
    finally:
        client.close()


def tally(dsn: str, redis_url: str, *loads: LoadGenerator) -> ledger.Tally:
    """Count the committed set (the fault ledger) against the jobs on the loads' queues."""
    rolled_back = set().union(*(load.rolled_back for load in loads))
    queues = {queue for load in loads for queue in load.queues.values()}
    with psycopg.connect(dsn) as conn:
        committed = {row[0] for row in conn.execute("SELECT job_id FROM fault_ledger")}
        dead = {row[0] for row in conn.execute("SELECT job_id FROM staged_jobs_dead")}
        remaining = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    return ledger.Tally(
        committed,
        delivered(redis_url, queues),
        dead,
        rolled_back,
        remaining=remaining[0] if remaining else -1,
    )


def scalar(dsn: str, query: str, params: Sequence[Any] = ()) -> Any:
    with psycopg.connect(dsn, connect_timeout=5) as conn:
        row = conn.execute(query, params).fetchone()  # type: ignore[arg-type]
    return None if row is None else row[0]


def remaining(dsn: str) -> int:
    return int(scalar(dsn, "SELECT count(*) FROM staged_jobs"))


def deleted(dsn: str) -> int:
    return int(scalar(dsn, "SELECT count(*) FROM fault_deletes"))


def leader_pid(dsn: str) -> int | None:
    """The backend pid holding an advisory lock in this database (the drain leader), if any."""
    value = scalar(
        dsn,
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    return None if value is None else int(value)


def wait_drained(dsn: str, timeout_s: float = DEADLINE_S) -> None:
    ledger.wait_until(lambda: remaining(dsn) == 0, timeout_s, "the staged-jobs table to drain")


# --- drain processes --------------------------------------------------------------------------


class DrainProcess:
    """One ``drain run`` subprocess with its log in a file."""

    def __init__(
        self,
        config: Path,
        log: Path,
        *,
        failpoints: str = "",
        once: bool = False,
        env: Mapping[str, str] | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        """``env`` adds variables; ``wrapper`` is a command to run the drain under (e.g. faketime)."""
        self.config = config
        self.log_path = log
        environment = {key: value for key, value in os.environ.items() if not key.startswith("DRAIN_")}
        environment["DRAIN_FAILPOINTS"] = failpoints
        environment.update(env or {})
        command = [
            *wrapper,
            sys.executable,
            "-c",
            "from drain.cli import entry_point; entry_point()",
            "run",
            "--config",
            str(config),
        ]
        if once:
            command.append("--once")
        self._log = open(log, "ab")  # noqa: SIM115 - closed in wait()/stop()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=environment)
        self.pid = self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout_s: float = DEADLINE_S) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            if self.process.returncode is not None:
                self._log.close()

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signum)

    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP): state T in /proc."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] in {"T", "t"}

    def stop(self) -> int:
        """SIGTERM (after SIGCONT in case it is frozen); SIGKILL if it does not exit in time."""
        if self.process.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self._log.close()
        return self.process.returncode


@contextlib.contextmanager
def running(*processes: DrainProcess) -> Iterator[None]:
    """Stop these drains (by their pids) whatever happens in the block."""
    try:
        yield
    finally:
        for process in processes:
            process.stop()


def throughput(dsn: str, since: float, until: float) -> float:
    """Committed deletes per second between two epoch times (from the audit table)."""
    count = scalar(
        dsn,
        "SELECT count(*) FROM fault_deletes WHERE at >= to_timestamp(%s) AND at < to_timestamp(%s)",
        (since, until),
    )
    return float(count) / max(until - since, 1e-9)


def first_delete_after(dsn: str, moment: float) -> float | None:
    """Epoch time of the first committed delete after ``moment``."""
    value = scalar(
        dsn, "SELECT extract(epoch FROM min(at)) FROM fault_deletes WHERE at > to_timestamp(%s)", (moment,)
    )
    return None if value is None else float(value)


def recovery_after(dsn: str, healed_at: float, timeout_s: float = DEADLINE_S) -> float:
    """Seconds from ``healed_at`` (epoch) to the first committed delete after it."""
    first = ledger.wait_until(lambda: first_delete_after(dsn, healed_at), timeout_s, "the drain to recover")
    return max(float(first) - healed_at, 0.0)


def fault_under_load(dsn: str, drain: DrainProcess, load: LoadGenerator, fault: Callable[[], float]) -> float:
    """The shape every outage case shares: run ``drain`` while ``load`` stages jobs, wait for
    progress, call ``fault`` (inject, wait, heal; it returns the epoch time it healed), measure the
    recovery, stop the load and wait for the table to drain. Returns the recovery in seconds."""
    with running(drain):
        load.start()
        try:
            ledger.wait_until(lambda: deleted(dsn) > 200, DEADLINE_S, "progress")
            healed_at = fault()
            recovery = recovery_after(dsn, healed_at)
            ledger.wait_until(
                lambda: first_delete_after(dsn, healed_at + 1.0), DEADLINE_S, "progress after the recovery"
            )
        finally:
            load.stop()
        wait_drained(dsn)
        assert drain.process.poll() is None, drain.log()
    return recovery


def with_application_name(dsn: str, name: str) -> str:
    """The DSN with ``application_name`` set, so each drain's sessions can be told apart."""
    return f"{dsn}{'&' if '?' in dsn else '?'}application_name={name}"


def report(case: str, result: ledger.Tally, **figures: Any) -> None:
    """One line per case for the README's guarantees table (shown with pytest -s / -rA)."""
    extra = " ".join(f"{key} {value}" for key, value in figures.items())
    print(f"\nFAULT {case}: {result} {extra}".rstrip())
