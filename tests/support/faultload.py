"""The fault suite's shape of load, its audit of deletes and its figures.

The load is tests.support.load's, shaped for outages (:func:`load`): one connection that
reconnects, the ledger (tests.support.ledger) as the committed set. An audit trigger records every
committed delete from the staged-jobs table with the deleting session's backend pid and application
name, so a test can tell which drain deleted what, and when. Deliveries are read back from Redis:
the RQ queue lists (:func:`tally`). The drains are tests.support.processes' (``start_drain``).
"""

from __future__ import annotations

import os
import random
import socket
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg
import redis

from tests.support import ledger, processes
from tests.support.load import Load
from tests.support.waiting import wait_until

JOB_NAME = "tests.support.faultload.noop"
DEADLINE_S = 120.0

PREPARE_SQL = """
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


# Ports for the tests' own servers, below the kernel's ephemeral range (32768 and up on Linux):
# a port the kernel hands out (bind to 0) is one a client connection may take as its own local
# port before the server, seconds later, binds it (a private RabbitMQ node then failed to start).
# Each xdist worker takes its own slice, and no process hands one port out twice.
PORTS_FROM = 20_000
PORTS_A_WORKER = 3_000
_given: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on right now (also usable as a 'server down' address)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    low = PORTS_FROM + (int(worker) % 4 if worker.isdigit() else 0) * PORTS_A_WORKER
    start = random.randrange(PORTS_A_WORKER)
    for offset in range(PORTS_A_WORKER):
        port = low + (start + offset) % PORTS_A_WORKER
        if port in _given:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {low}-{low + PORTS_A_WORKER - 1}")


def prepare(dsn: str) -> None:
    """Create the ledger and the delete audit in a migrated test database."""
    ledger.install(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(PREPARE_SQL)


# --- load -------------------------------------------------------------------------------------


def load(dsn: str, **shape: Any) -> Load:
    """The fault suite's load (``shape`` overrides): one connection that survives a database
    going away, 5 jobs per transaction, a fifth rolled back, none held open, a short pause."""
    defaults: dict[str, Any] = {
        "threads": 1,
        "per_transaction": 5,
        "rollback_fraction": 0.2,
        "hold_fraction": 0.0,
        "pace_s": 0.005,
        "seed": 4,
        "job": JOB_NAME,
        "reconnect": True,
    }
    return Load(dsn, **{**defaults, **shape})


def stage_committed(dsn: str, **shape: Any) -> Load:
    """Stage in this thread, without pauses, until the budget (``transactions``) is spent."""
    staged = load(dsn, pace_s=0, **shape)
    staged.run()
    return staged


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


def tally(dsn: str, redis_url: str, *loads: Load) -> ledger.Tally:
    """Count the committed set (the ledger) against the jobs on the loads' RQ queues."""
    rolled_back = set().union(*(load.rolled_back for load in loads))
    queues = {queue for load in loads for queue in load.queues.values()}
    return ledger.tally(dsn, delivered(redis_url, queues), rolled_back)


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
    first = wait_until("the drain to recover", lambda: first_delete_after(dsn, healed_at), timeout_s)
    return max(float(first) - healed_at, 0.0)


def fault_under_load(dsn: str, drain: processes.Process, load: Load, fault: Callable[[], float]) -> float:
    """The shape every outage case shares: run ``drain`` while ``load`` stages jobs, wait for
    progress, call ``fault`` (inject, wait, heal; it returns the epoch time it healed), measure the
    recovery, stop the load and wait for the table to drain. Returns the recovery in seconds."""
    with processes.running(drain):
        load.start()
        try:
            wait_until("progress", lambda: deleted(dsn) > 200, DEADLINE_S)
            healed_at = fault()
            recovery = recovery_after(dsn, healed_at)
            wait_until(
                "progress after the recovery", lambda: first_delete_after(dsn, healed_at + 1.0), DEADLINE_S
            )
        finally:
            load.stop()
        ledger.wait_drained(dsn, timeout_s=DEADLINE_S)
        assert drain.alive(), drain.output()
    return recovery


def report(case: str, result: ledger.Tally, **figures: Any) -> None:
    """One line per case for the README's guarantees table (shown with pytest -s / -rA)."""
    extra = " ".join(f"{key} {value}" for key, value in figures.items())
    print(f"\nFAULT {case}: {result} {extra}".rstrip())
