"""The idle leader's wake-up (issue 14): real Postgres, Redis and `drain run` processes.

- A commit wakes the idle leader at once: with the safety-net poll set to 15-30 s, every job
  reaches the broker within a few seconds (typically milliseconds), staged by drain.stage(), by
  a plain INSERT, by the SQL function from psql, and through a transaction-pooling PgBouncer.
- The trigger notifies only while the drain sleeps: no wake lock held, no notification; held,
  one notification per transaction however many INSERTs it makes.
- The race: a producer that staged a row while the drain was awake holds the wake lock shared
  until it ends, so the drain cannot arm (and sleep past its commit) meanwhile.
"""

from __future__ import annotations

import datetime
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

import drain
from drain import config
from drain.store import connection, writes
from drain.store import session as store
from tests.support import configs, pgbouncer, processes
from tests.support.waiting import wait_until

POLL_S = 30.0  # poll_min_s = poll_max_s: the safety net waits 15-30 s (jittered)
WAKE_BOUND_S = 5.0  # generous; a notification typically lands the job in milliseconds
JOB = "tests.support.tasks.record"


def wake_key(dsn: str, table: str = "staged_jobs") -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT hashtextextended(%s, 0)", (f"drain-wake:public.{table}",)).fetchone()
    assert row is not None
    return int(row[0])


def wake_lock_holder(dsn: str) -> int | None:
    """The backend pid holding the table's wake lock (an armed, sleeping leader), or None.

    Only in this database: the key is the same for every database with a table of that name, and
    other tests' drains sleep armed on the same server."""
    classid, objid = connection.split_key(wake_key(dsn))
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND mode = 'ExclusiveLock'"
            " AND classid = %s AND objid = %s AND objsubid = 1"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (classid, objid),
        ).fetchone()
    return None if row is None else int(row[0])


def queued(redis_url: str, queue: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.llen(f"rq:queue:{queue}"))
    finally:
        client.close()


@pytest.fixture
def sleepy_drain(database: str, redis_db: str, tmp_path: Path) -> Iterator[processes.Process]:
    """A `drain run` whose poll cannot explain a fast pickup, once it sleeps armed."""
    path = configs.write_config(
        tmp_path / "drain.toml",
        database,
        {"default": configs.rq(redis_db, allowed_jobs=[JOB])},
        poll_min_s=POLL_S,
        poll_max_s=POLL_S,
        wakeup_poll_max_s=POLL_S,
    )
    process = processes.start_drain(path, database, tmp_path / "drain.log")
    with processes.running(process):
        wait_until("the drain to lead and sleep armed", lambda: wake_lock_holder(database), 30)
        yield process


def wait_for_pickup(redis_url: str, queue: str, count: int, dsn: str) -> float:
    """Seconds from now until ``count`` jobs are on the queue, bounded by WAKE_BOUND_S; then
    wait until the drain sleeps armed again (so the next job also has to wake it)."""
    started = time.monotonic()
    wait_until(
        f"{count} jobs on the queue",
        lambda: queued(redis_url, queue) >= count,
        WAKE_BOUND_S,
        interval_s=0.002,
    )
    took = time.monotonic() - started
    wait_until("the drain to sleep armed again", lambda: wake_lock_holder(dsn), 30, interval_s=0.01)
    return took


def test_a_commit_wakes_the_sleeping_leader(
    sleepy_drain: processes.Process, database: str, redis_db: str, tmp_path: Path
) -> None:
    queue = f"wake-{uuid.uuid4().hex[:8]}"
    took: list[float] = []
    with psycopg.connect(database, autocommit=True) as conn:
        for n in range(5):
            with conn.transaction():
                drain.stage(conn, JOB, args=[n], queue=queue)
            took.append(wait_for_pickup(redis_db, queue, n + 1, database))
        # a plain INSERT, as any language's driver would send it
        conn.execute(
            "INSERT INTO staged_jobs (job_name, job_args, queue) VALUES (%s, '[9]', %s)", (JOB, queue)
        )
        took.append(wait_for_pickup(redis_db, queue, 6, database))
    # the SQL function from psql: another client, another language
    statement = f"SELECT drain_stage_v1('{JOB}', queue => '{queue}')"
    subprocess.run(
        ["psql", database, "-v", "ON_ERROR_STOP=1", "-qc", statement],
        check=True,
        capture_output=True,
    )
    took.append(wait_for_pickup(redis_db, queue, 7, database))
    assert max(took) < WAKE_BOUND_S, took  # the poll would have taken 15-30 s


def test_an_update_that_makes_a_row_due_wakes_the_sleeping_leader(
    sleepy_drain: processes.Process, database: str, redis_db: str
) -> None:
    """``UPDATE ... SET run_at = NULL`` forwards a parked or delayed row now (docs): it waited for
    the safety-net poll, counted as a missed wake-up (red team 25)."""
    queue = f"wake-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database, autocommit=True) as conn:
        with conn.transaction():
            drain.stage(
                conn,
                JOB,
                args=[1],
                queue=queue,
                run_at=datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1),
            )
        wait_until("the drain to sleep armed", lambda: wake_lock_holder(database), 30, interval_s=0.01)
        conn.execute("UPDATE staged_jobs SET run_at = NULL WHERE queue = %s", (queue,))
        took = wait_for_pickup(redis_db, queue, 1, database)
    assert took < WAKE_BOUND_S, took  # the poll would have taken 15-30 s


def test_releasing_a_row_parked_in_place_wakes_the_sleeping_leader(
    sleepy_drain: processes.Process, database: str, redis_db: str
) -> None:
    """``UPDATE ... SET last_error = NULL`` releases a row parked in place (docs): it waited for the
    safety-net poll, counted as a missed wake-up (red team 28)."""
    queue = f"wake-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(  # as the drain parks one in place when the table refuses every other write
            "INSERT INTO staged_jobs (job_name, job_args, queue, last_error) VALUES (%s, '[1]', %s, %s)",
            (JOB, queue, f"{writes.PARKED_IN_PLACE_PREFIX} the table refused its DELETE"),
        )
        wait_until("the drain to sleep armed", lambda: wake_lock_holder(database), 30, interval_s=0.01)
        assert queued(redis_db, queue) == 0
        conn.execute("UPDATE staged_jobs SET last_error = NULL WHERE queue = %s", (queue,))
        took = wait_for_pickup(redis_db, queue, 1, database)
    assert took < WAKE_BOUND_S, took  # the poll would have taken 15-30 s


def test_producers_behind_a_transaction_pool_wake_it(
    sleepy_drain: processes.Process, database: str, redis_db: str, tmp_path: Path
) -> None:
    queue = f"wake-{uuid.uuid4().hex[:8]}"
    dbname = psycopg.conninfo.conninfo_to_dict(database)["dbname"]
    with pgbouncer.pgbouncer(tmp_path, pool_mode="transaction", pool_size=2) as port:
        pooled = f"host=127.0.0.1 port={port} user=postgres dbname={dbname}"
        for n in range(3):
            with psycopg.connect(pooled, prepare_threshold=None) as conn:
                drain.stage(conn, JOB, args=[n], queue=queue)
            wait_for_pickup(redis_db, queue, n + 1, database)


@pytest.fixture
def listener(database: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    key = wake_key(database)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(f'LISTEN "drain_wake_{key & 0xFFFFFFFFFFFFFFFF:x}"')
        yield conn


def notifications(conn: psycopg.Connection[tuple[object, ...]], wait_s: float = 0.5) -> int:
    return sum(1 for _ in conn.notifies(timeout=wait_s))


def test_the_trigger_notifies_only_while_the_drain_sleeps(
    database: str, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    def stage_three() -> None:
        with psycopg.connect(database) as conn:  # one transaction, three INSERT statements
            for n in range(3):
                drain.stage(conn, "app.t", args=[n])

    stage_three()
    assert notifications(listener) == 0, "nobody sleeps: a producer must not pay for NOTIFY"

    sleeper = store.Store(config.Settings(dsn=database))
    try:
        armed, channel = sleeper.wake_arm()
        assert armed and channel == f"drain_wake_{wake_key(database) & 0xFFFFFFFFFFFFFFFF:x}"
        stage_three()
        assert notifications(listener) == 1, "the sleeping drain is notified once per transaction"
        sleeper.wake_disarm()
        stage_three()
        assert notifications(listener) == 0, "awake again: no notification"
    finally:
        sleeper.close()


def test_the_drain_cannot_arm_while_a_producer_that_did_not_notify_is_open(database: str) -> None:
    sleeper = store.Store(config.Settings(dsn=database))
    try:
        with psycopg.connect(database) as producer:
            drain.stage(producer, "app.t")  # the drain is awake: no notification, lock held shared
            armed, _ = sleeper.wake_arm()
            assert not armed, "armed past an open producer"
            due = sleeper.anything_due()
            assert due == store.Due(False, False, None), "the open producer's row is not visible yet"
        armed, _ = sleeper.wake_arm()  # the producer committed: its row is visible to the check
        assert armed
        assert sleeper.anything_due() == store.Due(True, False, None)
    finally:
        sleeper.close()


def test_migrate_keeps_one_trigger(database: str) -> None:
    db = store.Store(config.Settings(dsn=database))
    try:
        db.migrate()
        db.migrate()
        assert db.wake_trigger_enabled()
    finally:
        db.close()
    with psycopg.connect(database) as conn:
        row = conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = 'drain_wake'").fetchone()
    assert row == (1,)


@pytest.mark.parametrize(("schema", "table"), [("App", "MyJobs"), ("public", "x" * 46), ("s_1", "_jobs_2")])
def test_the_trigger_and_the_drain_agree_on_any_valid_names(database: str, schema: str, table: str) -> None:
    settings = config.Settings(dsn=database, schema=schema, table=table)
    sleeper = store.Store(settings)
    try:
        sleeper.migrate()
        armed, channel = sleeper.wake_arm()
        assert armed
        with psycopg.connect(database, autocommit=True) as listening:
            listening.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
            with psycopg.connect(database) as conn:
                drain.stage(conn, "app.t", table=table, schema=schema)
            assert notifications(listening) == 1
    finally:
        sleeper.close()
