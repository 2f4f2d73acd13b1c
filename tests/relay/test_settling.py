"""Settle or do not publish (G10), in-process against a real Postgres with the in-memory backend:

- a session that cannot settle (read-only, a DELETE trigger that refuses) never leads, says why,
  and ends the loop (CannotSettle, exit 6) once that lasted ``settle_timeout_s``;
- a settlement that fails mid-run keeps its jobs: only their settlement is tried again, with
  backoff, nothing new is published, each job is published once;
- an app's row lock on a staged row neither stalls nor duplicates the batch, whole or pipelined;
- a select that meets a row changed since the step's snapshot looks again, without stepping down;
- a database's idle_session_timeout does not apply to the drain's own sessions: theirs is derived
  from the drain's longest silence (so a frozen leader's session ends: tests/faults/test_freeze.py),
  nor its transaction_timeout (PostgreSQL 17+): theirs is off, and the server's TCP keepalives on
  their sockets are the drain's.

The same faults with real ``drain run`` processes and RabbitMQ: tests/faults/test_cannot_settle.py.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator

import psycopg
import pytest

import drain
from drain import config, errors, testing
from drain.relay import leadership
from drain.relay import loop as relay
from drain.store import connection
from drain.store import session as store
from tests.conftest import ManualClock
from tests.support import faultload, relays
from tests.support.waiting import steps_until

SETTLE_TIMEOUT_S = 5.0
RAISING_TRIGGER = """
CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'refusing to delete staged job %', OLD.job_id; END $$;
CREATE TRIGGER refuse_delete BEFORE DELETE ON staged_jobs FOR EACH ROW EXECUTE FUNCTION refuse_delete();
"""
DROP_TRIGGER = "DROP TRIGGER refuse_delete ON staged_jobs; DROP FUNCTION refuse_delete()"


def stage(dsn: str, count: int) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [str(i) for i in drain.stage_many(conn, [drain.Job("app.t", args=[n]) for n in range(count)])]


def execute(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement.encode())


def remaining(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    return int(row[0]) if row else -1


def gauge(the_relay: relay.Relay, name: str, **labels: str) -> float | None:
    return the_relay.metrics.registry.get_sample_value(name, labels)


def standby(settings: config.Settings, memory: testing.MemoryAdapter, clock: ManualClock) -> relay.Relay:
    """A relay that has not tried to lead yet."""
    settings = dataclasses.replace(
        settings,
        batch_size=100,
        settle_timeout_s=SETTLE_TIMEOUT_S,
        backends={"default": config.BackendSettings("default", "memory", 3, {})},
    )
    return relay.Relay(settings, {"default": memory}, clock=clock, jitter=lambda: 0.0)


@pytest.fixture
def fresh(
    settings: config.Settings, memory: testing.MemoryAdapter, clock: ManualClock
) -> Iterator[relay.Relay]:
    the_relay = standby(settings, memory, clock)
    yield the_relay
    the_relay.shutdown()


def test_a_read_only_session_never_leads_and_says_why(
    settings: config.Settings, memory: testing.MemoryAdapter, clock: ManualClock
) -> None:
    read_only = f"{settings.dsn}?options=-c%20default_transaction_read_only%3Don"
    the_relay = standby(dataclasses.replace(settings, dsn=read_only), memory, clock)
    try:
        stage(settings.dsn, 5)
        the_relay.turn()
        assert not the_relay.leadership.is_leader and memory.published == []
        blocker = the_relay.leadership.blocker
        assert blocker is not None and blocker.reason == leadership.READ_ONLY
        assert gauge(the_relay, "drain_cannot_settle", reason="read_only") == 1
        clock.advance(SETTLE_TIMEOUT_S)
        with pytest.raises(errors.CannotSettle, match="read-only"):
            the_relay.turn()
        assert memory.published == [] and remaining(settings.dsn) == 5
    finally:
        the_relay.shutdown()


def test_a_delete_trigger_that_refuses_is_found_before_anything_is_published(
    fresh: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    stage(database, 5)
    execute(database, RAISING_TRIGGER)
    fresh.turn()
    assert not fresh.leadership.is_leader and memory.published == []
    blocker = fresh.leadership.blocker
    assert blocker is not None and blocker.reason == leadership.DELETE_FAILS
    assert "refusing to delete staged job" in blocker.detail
    assert faultload.leader_pid(database) is None  # it unlocked again: another drain may lead
    execute(database, DROP_TRIGGER)
    fresh.turn()
    assert fresh.leadership.is_leader and len(memory.published) == 5 and remaining(database) == 0


def test_a_settlement_failing_mid_run_is_retried_alone_then_the_drain_exits(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str, clock: ManualClock
) -> None:
    first = stage(database, 10)
    execute(database, RAISING_TRIGGER)  # after the lead's probe: the failure begins mid-run
    leader.turn()
    assert len(memory.published) == 10 and leader.settler.held.failing and leader.settler.held.jobs == 10
    stage(database, 10)
    for _ in range(3):  # each backoff: only the failed settlement is tried, nothing new published
        clock.advance(leader.settler.held.wait_s())
        leader.turn()
    assert len(memory.published) == 10 and leader.leadership.is_leader
    assert gauge(leader, "drain_cannot_settle", reason="settlement_failed") == 1
    assert gauge(leader, "drain_unsettled_jobs") == 10
    assert (gauge(leader, "drain_settlement_failures_total") or 0) >= 4
    execute(database, DROP_TRIGGER)  # healed: the kept settlement is written, then the rest flows
    clock.advance(leader.settler.held.wait_s())
    steps_until(leader.turn, lambda _: remaining(database) == 0, "draining")
    published = collections.Counter(str(job.job_id) for job in memory.published)
    assert set(first) <= published.keys() and len(published) == 20 and max(published.values()) == 1
    assert gauge(leader, "drain_cannot_settle", reason="settlement_failed") == 0
    stage(database, 3)  # the same failure again, now for longer than settle_timeout_s
    execute(database, RAISING_TRIGGER)
    leader.turn()
    with pytest.raises(errors.CannotSettle, match="refusing to delete"):
        for _ in range(100):
            clock.advance(max(leader.settler.held.wait_s(), 1.0))
            leader.turn()
    assert len(memory.published) == 23


@pytest.mark.parametrize("pipelined", [False, True], ids=["whole batch", "pipelined"])
def test_an_app_row_lock_neither_stalls_nor_duplicates_the_batch(
    settings: config.Settings, database: str, clock: ManualClock, pipelined: bool
) -> None:
    adapter = testing.PipelinedMemoryAdapter("default") if pipelined else testing.MemoryAdapter("default")
    # A stalled DELETE would wait for the statement timeout, then the step would fail: short here.
    leader = relays.leading(
        settings, {"default": adapter}, clock, statement_timeout_s=2.0, pipeline_depth=2 if pipelined else 0
    )
    ids = stage(database, 20)
    app = psycopg.connect(database)
    try:
        if pipelined:
            leader.drain_step()  # all 20 submitted, in flight: their rows are not locked now
        app.execute("SELECT 1 FROM staged_jobs WHERE job_id = %s FOR UPDATE", [ids[7]])
        steps_until(leader.drain_step, lambda _: remaining(database) == 1, "the others to flow", 10)
        assert leader.leadership.is_leader
        app.rollback()  # the app lets go: that row goes, once
        steps_until(leader.drain_step, lambda _: remaining(database) == 0, "the held row", 10)
        leader.settle_in_flight()
    finally:
        app.close()
        leader.shutdown()
    published = collections.Counter(str(job.job_id) for job in adapter.published)
    assert sorted(published) == sorted(ids) and max(published.values()) == 1
    assert not gauge(leader, "drain_settlement_failures_total")  # no DELETE waited for the app


def test_a_select_that_meets_a_row_changed_since_the_snapshot_looks_again(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = stage(database, 10)
    select_due = store.Batch.select_due
    cancelled: list[str] = []

    def cancel_first(batch: store.Batch, *args: object) -> object:
        if not cancelled:  # an app cancels a job after this step's snapshot, before its select
            cancelled.append(ids[0])
            execute(database, f"DELETE FROM staged_jobs WHERE job_id = '{ids[0]}'")
        return select_due(batch, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(store.Batch, "select_due", cancel_first)
    pid = leader.leadership.pid
    leader.metrics.tick()
    assert leader.turn() == 0.0  # 40001: look again at once, no step down
    assert leader.leadership.pid == pid and memory.published == []
    leader.turn()
    assert sorted(str(job.job_id) for job in memory.published) == sorted(ids[1:])


def test_the_databases_idle_session_timeout_does_not_apply_to_the_drains_sessions(
    settings: config.Settings, database: str
) -> None:
    name = database.rsplit("/", 1)[1]
    execute(database, f"ALTER DATABASE \"{name}\" SET idle_session_timeout = '200ms'")
    with psycopg.connect(database) as app:
        assert app.execute("SHOW idle_session_timeout").fetchone() == ("200ms",)
    conn = connection.connect(settings)
    try:
        assert conn.execute("SHOW idle_session_timeout").fetchone() == ("20s",)  # 10 s armed poll + 10
        assert connection.idle_session_timeout_ms(settings) == 20_000
    finally:
        conn.close()


def test_the_databases_transaction_timeout_does_not_apply_to_the_drains_sessions(
    settings: config.Settings, database: str
) -> None:
    with psycopg.connect(database) as app:
        version = app.info.server_version
    if version < 170000:
        pytest.skip(f"transaction_timeout is PostgreSQL 17+ (this server is {version // 10000})")
    name = database.rsplit("/", 1)[1]
    execute(database, f"ALTER DATABASE \"{name}\" SET transaction_timeout = '200ms'")
    with psycopg.connect(database) as app, pytest.raises(psycopg.errors.TransactionTimeout):
        app.execute("SELECT pg_sleep(2)")  # the database's value ends an app's transaction
    conn = connection.connect(settings, autocommit=False)  # a leader's term is one long transaction
    try:
        assert conn.execute("SHOW transaction_timeout").fetchone() == ("0",)
        assert conn.execute("SELECT pg_sleep(1), 1").fetchone() == ("", 1)
        conn.commit()
    finally:
        conn.close()


def test_the_servers_keepalives_on_the_drains_sockets_are_the_drains(settings: config.Settings) -> None:
    conn = connection.connect(settings)  # over TCP: the server's values are its socket's
    try:
        shown = conn.execute(
            "SELECT current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'), "
            "current_setting('tcp_keepalives_count'), current_setting('tcp_user_timeout')"
        ).fetchone()
    finally:
        conn.close()
    assert shown == ("5", "2", "3", "10000")  # seconds; tcp_user_timeout in ms (was 7200, 75, 9, 0)
