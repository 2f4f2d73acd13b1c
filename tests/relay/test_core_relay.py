"""drain_once() and leadership against a real Postgres, with the in-memory backend.

The in-memory adapter is for these tests of the loop only; delivery to real brokers is proven in
the integration, contract and fault suites.
"""

from __future__ import annotations

import dataclasses
import threading

import psycopg
import pytest

import drain
from drain import config, errors, testing
from drain.relay import loop as relay
from tests.conftest import ManualClock
from tests.support.waiting import steps_until


def stage(dsn: str, count: int) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [str(i) for i in drain.stage_many(conn, [drain.Job("app.t", args=[n]) for n in range(count)])]


def table(dsn: str, name: str = "staged_jobs") -> list[dict[str, object]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cursor:
        return cursor.execute(f"SELECT * FROM {name} ORDER BY id").fetchall()


def test_publishes_then_deletes_exactly_the_batch(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    ids = stage(database, 250)
    first = leader.drain_once()
    assert (first.selected, first.published, first.full) == (100, 100, True)
    assert len(table(database)) == 150
    steps_until(leader.drain_once, lambda report: not report.selected, "draining the table")
    assert [str(job.job_id) for job in memory.published] == ids  # id order, each once
    assert table(database) == []


def test_rolled_back_and_uncommitted_rows_are_never_published(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    with psycopg.connect(database) as held, psycopg.connect(database) as rolled:
        drain.stage(rolled, "app.rolled_back")
        rolled.rollback()
        drain.stage(held, "app.held")  # lower id, commits after a later row
        stage(database, 1)
        leader.drain_once()
        assert [job.job_name for job in memory.published] == ["app.t"]
        held.commit()
    leader.drain_once()
    assert [job.job_name for job in memory.published] == ["app.t", "app.held"]
    assert table(database) == []


def test_future_rows_wait_for_run_at(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    with psycopg.connect(database) as conn:
        drain.stage(conn, "app.later", delay=3600)
        drain.stage(conn, "app.soon", delay=0.3)
    leader.drain_once()
    assert memory.published == []
    wait = leader.store.seconds_until_due()
    assert wait is not None
    assert 0 < wait <= 0.3
    deadline = threading.Event()
    for _ in range(100):
        if leader.drain_once().published:
            break
        deadline.wait(0.05)
    assert [job.job_name for job in memory.published] == ["app.soon"]
    assert len(table(database)) == 1


def test_rejected_job_backs_off_then_dies_without_blocking_others(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    memory.behaviour = lambda job: "reject" if job.job_name == "app.poison" else "ack"
    with psycopg.connect(database) as conn:
        drain.stage(conn, "app.poison")
        drain.stage_many(conn, [drain.Job("app.t", args=[i]) for i in range(5)])
    report = leader.drain_once()
    assert (report.published, report.rejected, report.dead) == (5, 1, 0)
    (row,) = table(database)
    assert row["attempts"] == 1 and row["last_error"] == "memory: rejected" and row["run_at"] is not None
    for _ in range(200):  # retry_base_s is tiny in the test settings
        if table(database) == []:
            break
        leader.drain_once()
        threading.Event().wait(0.02)
    (dead,) = table(database, "staged_jobs_dead")
    assert dead["job_name"] == "app.poison" and dead["attempts"] == 3 and dead["error"] == "memory: rejected"
    assert len(memory.published) == 5


def test_unknown_backend_is_rejected_not_blocking(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    with psycopg.connect(database) as conn:
        drain.stage(conn, "app.x", backend="nope")
        drain.stage(conn, "app.y")
    report = leader.drain_once()
    assert report.published == 1 and report.rejected == 1
    (row,) = table(database)
    assert "no backend named 'nope'" in str(row["last_error"])


def test_retry_counts_no_attempt(leader: relay.Relay, memory: testing.MemoryAdapter, database: str) -> None:
    memory.behaviour = lambda job: "retry"
    stage(database, 2)
    report = leader.drain_once()
    assert report.retried == 2
    assert [row["attempts"] for row in table(database)] == [0, 0]


def test_backend_down_touches_nothing_and_pauses(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str, clock: ManualClock
) -> None:
    stage(database, 10)
    memory.down = True
    report = leader.drain_once()
    assert report.skipped == 10 and report.published == 0
    rows = table(database)
    assert len(rows) == 10 and all(row["attempts"] == 0 and row["run_at"] is None for row in rows)
    assert leader.drain_once().selected == 0  # paused: not even read
    memory.down = False
    clock.advance(3600)  # the pause is over
    steps_until(leader.drain_once, lambda report: not report.selected, "draining the table")
    assert table(database) == [] and len(memory.published) == 10
    assert table(database, "staged_jobs_dead") == []


def test_only_one_leader(leader: relay.Relay, settings: config.Settings) -> None:
    other = relay.Relay(settings, {})
    try:
        assert not other.leadership.try_acquire()
        leader.shutdown()
        assert other.leadership.try_acquire()
    finally:
        other.shutdown()


def test_a_leader_that_lost_its_session_cannot_delete(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    stage(database, 3)
    with psycopg.connect(database, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [leader.leadership.pid])
    with pytest.raises((psycopg.OperationalError, errors.LeadershipLost)):
        leader.drain_once()
    assert len(table(database)) == 3


def test_lock_check_fails_when_the_lock_was_released_behind_our_back(
    leader: relay.Relay, database: str
) -> None:
    leader.store.unlock(leader.leadership.key)
    with pytest.raises(errors.LeadershipLost):
        leader.drain_once()


def test_run_loop_stops_on_event_and_releases(
    settings: config.Settings, memory: testing.MemoryAdapter, database: str
) -> None:
    the_relay = relay.Relay(settings, {"default": memory})
    stage(database, 20)
    stop = threading.Event()
    thread = threading.Thread(target=the_relay.run, args=(stop,))
    thread.start()
    try:
        for _ in range(400):
            if len(memory.published) == 20:
                break
            stop.wait(0.05)
        assert len(memory.published) == 20
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    with psycopg.connect(database) as conn:
        holders = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
    assert holders == (0,)


def test_a_batch_reads_and_deletes_under_one_repeatable_read_snapshot(leader: relay.Relay) -> None:
    with leader.store.batch():
        (level,) = leader.store.conn.execute("SHOW transaction_isolation").fetchone() or ("",)
    assert level == "repeatable read"
    (outside,) = leader.store.conn.execute("SHOW transaction_isolation").fetchone() or ("",)
    assert outside == "read committed"  # the lock session itself stays in autocommit
    assert leader.store.conn.autocommit


def test_a_standby_never_opens_a_backend_connection(
    leader: relay.Relay, settings: config.Settings, database: str
) -> None:
    stage(database, 5)
    standby_backend = testing.MemoryAdapter("default")
    standby = relay.Relay(dataclasses.replace(settings, standby_retry_s=0.01), {"default": standby_backend})
    attempts: list[bool] = []
    original = standby.begin_term

    def counted() -> bool:
        attempts.append(original())
        return attempts[-1]

    standby.begin_term = counted  # type: ignore[method-assign]
    stop = threading.Event()
    thread = threading.Thread(target=standby.run, args=(stop,))
    thread.start()
    try:
        for _ in range(400):
            if len(attempts) >= 5:
                break
            stop.wait(0.05)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert len(attempts) >= 5 and not any(attempts)
    assert standby_backend.opened == 0 and standby_backend.published == []


def test_rows_the_batch_did_not_publish_are_never_deleted_with_it(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    """Only the published ids are deleted, never a range: a lower id the batch skipped (deferred
    here; a paused backend's or one in flight likewise) stays staged."""
    with psycopg.connect(database) as conn:
        drain.stage(conn, "app.later", delay=3600)  # the lowest id, not due
    stage(database, 5)
    assert leader.drain_once().published == 5
    assert [row["job_name"] for row in table(database)] == ["app.later"]
    assert "app.later" not in [job.job_name for job in memory.published]
