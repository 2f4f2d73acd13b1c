"""The scheduler against a real Postgres: a tick's job and its last tick commit together, once.

The in-memory backend stands in for a broker (what is proven here is the staging); a trigger
(tests.support.ticks) records every committed tick's job before the relay forwards and deletes it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from drain import config, testing
from drain.relay import leadership, schedules
from drain.relay import loop as relay
from drain.store import session as store
from drain.store import sql
from tests.support import ticks
from tests.support.waiting import wait_until

EVERY_SECOND = "* * * * * *"
DAILY = "0 0 * * *"  # the catch-up tests' ticks: whole days back, so a second boundary changes nothing


class Clock:
    """A monotonic clock the test moves, so the scheduler's pass gating is deterministic."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_settings(base: config.Settings, *entries: config.ScheduleSettings) -> config.Settings:
    return dataclasses.replace(
        base,
        backends={"default": config.BackendSettings("default", "memory", 3, {})},
        schedules=tuple(entries),
    )


def every_second(name: str = "tick", **fields: Any) -> config.ScheduleSettings:
    return config.ScheduleSettings(name=name, cron=EVERY_SECOND, job_name="app.tasks.tick", **fields)


@dataclasses.dataclass
class Leader:
    scheduler: schedules.Scheduler
    store: store.Store
    leadership: leadership.Leadership
    clock: Clock


@pytest.fixture
def lead(settings: config.Settings, database: str) -> Iterator[Any]:
    """Build leaders (a store holding the lock, and its scheduler) for given schedules."""
    ticks.install(database)
    made: list[Leader] = []

    def build(*entries: config.ScheduleSettings) -> Leader:
        full = make_settings(settings, *entries)
        db = store.Store(full)
        held = leadership.Leadership(db)
        if made:  # a later leader of the same table: the previous one steps down first
            made[-1].leadership.release()
        assert held.try_acquire()
        clock = Clock()
        leader = Leader(schedules.Scheduler(full, db, held, clock=clock), db, held, clock)
        made.append(leader)
        return leader

    yield build
    for leader in made:
        leader.leadership.release()
        leader.store.close()


def daily(name: str = "tick", **fields: Any) -> config.ScheduleSettings:
    return config.ScheduleSettings(name=name, cron=DAILY, job_name="app.tasks.tick", **fields)


def set_last_tick(dsn: str, name: str, days_ago: int) -> datetime.datetime:
    """Move a schedule's last tick back to the midnight (UTC) ``days_ago`` on the database clock."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "UPDATE staged_jobs_schedules SET last_tick = date_trunc('day', now() AT TIME ZONE 'UTC') "
            "AT TIME ZONE 'UTC' - make_interval(days => %s) WHERE name = %s RETURNING last_tick",
            (days_ago, name),
        ).fetchone()
    assert row is not None
    value: datetime.datetime = row[0]
    return value


def schedule_rows(dsn: str) -> dict[str, dict[str, Any]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cursor:
        return {row["name"]: row for row in cursor.execute("SELECT * FROM staged_jobs_schedules").fetchall()}


def test_first_pass_records_the_schedule_and_stages_nothing(lead: Any, database: str) -> None:
    leader = lead(every_second())
    assert leader.scheduler.stage_due() == 0
    row = schedule_rows(database)["tick"]
    assert (row["cron"], row["timezone"], row["last_job_id"]) == (EVERY_SECOND, "UTC", None)
    assert ticks.staged(database) == []
    assert 0 < (leader.scheduler.wait_s() or 0) <= 1.0  # wakes for the next second's tick


def test_no_transaction_is_opened_until_a_tick_may_be_due(
    lead: Any, database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Called on every loop turn (full batches included), the scheduler stays out of the way."""
    leader = lead(daily())
    leader.scheduler.stage_due()
    wait = leader.scheduler.wait_s()
    assert wait == schedules.RECHECK_S  # the next midnight is further away than a recheck

    def no_batch() -> None:
        raise AssertionError("the scheduler opened a transaction with no tick due")

    monkeypatch.setattr(leader.store, "batch", no_batch)
    for _ in range(1000):
        assert leader.scheduler.stage_due() == 0
    leader.clock.now += wait - 0.001
    assert leader.scheduler.stage_due() == 0


def test_due_ticks_are_staged_with_their_job_id_run_at_and_metadata(lead: Any, database: str) -> None:
    leader = lead(daily(args=(1,), kwargs={"k": "v"}, queue="q", options={"meta": {"mine": True}}))
    leader.scheduler.stage_due()
    last = set_last_tick(database, "tick", 3)
    leader.clock.now += schedules.RECHECK_S
    assert leader.scheduler.stage_due() == 3  # within the term: every tick since the last one
    staged = ticks.staged(database, "tick")
    expected = [last + datetime.timedelta(days=s) for s in (1, 2, 3)]
    assert [row.tick for row in staged] == expected
    names = sql.Names("public", "staged_jobs")
    assert [row.job_id for row in staged] == [str(schedules.tick_job_id(names, "tick", t)) for t in expected]
    with psycopg.connect(database) as conn:
        rows = conn.execute(
            "SELECT job_name, job_args, job_kwargs, queue, backend, run_at, options FROM staged_jobs "
            "ORDER BY run_at"
        ).fetchall()
    assert [row[5] for row in rows] == expected
    assert rows[0][:5] == ("app.tasks.tick", [1], {"k": "v"}, "q", "default")
    assert rows[0][6] == {  # the tick as reserved options, which the adapters pass on (RQ: job.meta)
        "meta": {"mine": True},
        "drain_schedule": "tick",
        "drain_tick": expected[0].isoformat(),
    }
    row = schedule_rows(database)["tick"]
    assert row["last_tick"] == expected[-1]
    assert str(row["last_job_id"]) == staged[-1].job_id
    # the same instant again stages nothing more
    leader.clock.now += schedules.RECHECK_S
    leader.scheduler.stage_due()
    assert ticks.duplicates(ticks.staged(database)) == {}


@pytest.mark.parametrize(("catch_up", "expected"), [("all", 4), ("latest", 1), ("none", 0)])
def test_a_new_leader_follows_catch_up_for_ticks_missed_before_its_term(
    lead: Any, database: str, catch_up: str, expected: int
) -> None:
    lead(daily(catch_up=catch_up)).scheduler.stage_due()
    last = set_last_tick(database, "tick", 4)
    successor = lead(daily(catch_up=catch_up))
    assert successor.scheduler.stage_due() == expected
    staged = [row.tick for row in ticks.staged(database)]
    assert staged == [last + datetime.timedelta(days=s) for s in range(5 - expected, 5)]
    assert schedule_rows(database)["tick"]["last_tick"] >= last + datetime.timedelta(days=4)


def test_catch_up_all_is_capped_to_the_most_recent(lead: Any, database: str) -> None:
    lead(daily(catch_up="all", catch_up_max=2)).scheduler.stage_due()
    last = set_last_tick(database, "tick", 10)
    assert lead(daily(catch_up="all", catch_up_max=2)).scheduler.stage_due() == 2
    assert [row.tick for row in ticks.staged(database)] == [
        last + datetime.timedelta(days=s) for s in (9, 10)
    ]


def test_a_concurrent_writer_of_the_schedule_rows_makes_the_pass_fail_not_stage_twice(
    lead: Any, database: str
) -> None:
    leader = lead(daily(catch_up="all"))
    leader.scheduler.stage_due()
    set_last_tick(database, "tick", 3)
    leader.clock.now += schedules.RECHECK_S
    # Another session (a leader that should not exist) holds the rows, then advances them.
    other = psycopg.connect(database)
    other.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    other.execute("SELECT * FROM staged_jobs_schedules FOR UPDATE")
    failure: list[BaseException] = []

    def run_pass() -> None:
        try:
            leader.scheduler.stage_due()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run_pass)
    thread.start()
    wait_until(
        "the scheduler's pass to wait for the row lock", lambda: ticks_waiting(database), 10, interval_s=0.05
    )
    other.execute("UPDATE staged_jobs_schedules SET last_tick = now()")
    other.commit()
    other.close()
    thread.join(10)
    assert failure and isinstance(failure[0], psycopg.errors.SerializationFailure), failure
    assert ticks.staged(database) == []


def test_a_tick_whose_job_is_still_staged_is_not_staged_again(
    lead: Any, database: str, caplog: pytest.LogCaptureFixture
) -> None:
    leader = lead(daily(catch_up="all"))
    leader.scheduler.stage_due()
    set_last_tick(database, "tick", 2)
    leader.clock.now += schedules.RECHECK_S
    assert leader.scheduler.stage_due() == 2
    set_last_tick(database, "tick", 2)  # the history went back (a restored backup, say)
    with psycopg.connect(database) as conn:  # and one of the two is backing off after a failure
        conn.execute(
            "UPDATE staged_jobs SET attempts = 1, last_error = 'e', run_at = now() + interval '1 minute' "
            "WHERE id = (SELECT min(id) FROM staged_jobs)"
        )
    leader.clock.now += schedules.RECHECK_S
    with caplog.at_level(logging.WARNING, logger="drain.relay.schedules"):
        assert leader.scheduler.stage_due() == 0  # the same ticks: the same job ids, still staged
    assert sum("is already staged" in record.message for record in caplog.records) == 2
    with psycopg.connect(database) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    assert row is not None and row[0] == 2


SQUATTERS = {  # a row an app (or an attacker) staged first under a tick's job id, by what differs
    "name": {"job_name": "app.tasks.evil"},
    "args": {"job_args": ["rm -rf"]},
    "queue": {"queue": "elsewhere"},
    "backend": {"backend": "other"},
    "run_at": {"run_at": "9998-01-01T00:00:00+00:00"},  # the tick's own content, parked for ever
}


@pytest.mark.parametrize("differs", sorted(SQUATTERS))
def test_a_row_holding_a_ticks_job_id_does_not_take_the_tick(
    lead: Any, database: str, caplog: pytest.LogCaptureFixture, differs: str
) -> None:
    """Before: the tick's INSERT met the squatter's job id, staged nothing, and said the tick was
    already staged: it never ran (or the squatter's content ran as the tick)."""
    leader = lead(daily(args=(1,), queue="q"))
    leader.scheduler.stage_due()
    tick = set_last_tick(database, "tick", 1) + datetime.timedelta(days=1)
    names = sql.Names("public", "staged_jobs")
    taken = schedules.tick_job_id(names, "tick", tick)
    squatter = {
        **schedules.tick_job(leader.scheduler.schedules[0], tick, taken),
        **SQUATTERS[differs],
    }
    with psycopg.connect(database) as conn:
        conn.execute(
            "INSERT INTO staged_jobs "
            "(job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options) "
            "SELECT * FROM jsonb_to_recordset(%s::jsonb) AS j(job_name text, job_args jsonb, "
            "job_kwargs jsonb, queue text, backend text, job_id uuid, run_at timestamptz, options jsonb)",
            [json.dumps([squatter])],
        )
    leader.clock.now += schedules.RECHECK_S
    with caplog.at_level(logging.WARNING, logger="drain.relay.schedules"):
        assert leader.scheduler.stage_due() == 1
    with psycopg.connect(database) as conn:
        rows = conn.execute(
            "SELECT job_id, job_name, job_args, queue, backend, run_at FROM staged_jobs WHERE job_id <> %s",
            [taken],
        ).fetchall()
        held = conn.execute("SELECT job_name FROM staged_jobs WHERE job_id = %s", [taken]).fetchone()
    ((fresh, *tick_row),) = rows
    assert tick_row == ["app.tasks.tick", [1], "q", "default", tick]
    assert held is not None and held[0] == squatter["job_name"]  # the squatter's row is left alone
    assert schedule_rows(database)["tick"]["last_job_id"] == fresh
    (record,) = [r for r in caplog.records if getattr(r, "event", "") == "schedule_tick_id_taken"]
    assert record.levelno == logging.WARNING
    assert str(taken) in record.getMessage() and str(fresh) in record.getMessage()
    standard = vars(logging.makeLogRecord({}))  # thread id, times: digits that may hold "9998" by chance
    extra = {k: str(v) for k, v in record.__dict__.items() if k not in standard}
    said = record.getMessage() + json.dumps(extra)
    assert "evil" not in said and "rm -rf" not in said and "elsewhere" not in said and "9998" not in said


def ticks_waiting(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()"
        ).fetchone()
    return bool(row and row[0])


def test_a_removed_schedule_stops_and_keeps_its_row(lead: Any, database: str) -> None:
    lead(daily("kept"), daily("removed")).scheduler.stage_due()
    set_last_tick(database, "kept", 2)
    set_last_tick(database, "removed", 2)
    before = schedule_rows(database)["removed"]
    successor = lead(daily("kept", catch_up="all"))
    assert successor.scheduler.stage_due() == 2
    assert {row.schedule for row in ticks.staged(database)} == {"kept"}
    assert schedule_rows(database)["removed"] == before
    listed = {
        entry["name"]: entry for entry in schedules.listing(successor.store, successor.scheduler.schedules)
    }
    assert listed["removed"]["configured"] is False
    assert listed["removed"]["last_tick"] == before["last_tick"]
    assert listed["removed"]["next_tick"] is None
    assert listed["kept"]["configured"] is True
    assert listed["kept"]["next_tick"] > listed["kept"]["last_tick"]


def test_a_missing_schedules_table_is_logged_once_and_forwarding_goes_on(
    lead: Any, database: str, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("DROP TABLE staged_jobs_schedules")
    leader = lead(every_second())
    with caplog.at_level(logging.ERROR, logger="drain.relay.schedules"):
        assert leader.scheduler.stage_due() == 0
        leader.clock.now += 1000
        assert leader.scheduler.stage_due() == 0
    assert [r.message for r in caplog.records].count(
        'table "public"."staged_jobs_schedules" does not exist: schedules are not staged; run `drain migrate`'
    ) == 1


def test_the_relay_loop_stages_each_tick_once_and_wakes_for_it(
    settings: config.Settings, database: str
) -> None:
    """poll_max_s is 5 s and the schedule ticks every 3 s, so the idle poll has backed off to
    seconds before each tick: each is still staged within a fraction of a second of it."""
    ticks.install(database)
    every_3s = config.ScheduleSettings(
        name="tick", cron="*/3 * * * * *", job_name="app.tasks.tick", catch_up="all"
    )
    full = dataclasses.replace(make_settings(settings, every_3s), poll_max_s=5.0)
    memory = testing.MemoryAdapter("default")
    the_relay = relay.Relay(full, {"default": memory})
    stop = threading.Event()
    thread = threading.Thread(target=the_relay.run, args=(stop,))
    thread.start()
    try:
        wait_until("three ticks staged", lambda: len(ticks.staged(database)) >= 3, 20)
        wait_until("three ticks forwarded", lambda: len(memory.published) >= 3, 10)
    finally:
        stop.set()
        thread.join(30)
    staged = ticks.staged(database)
    assert ticks.duplicates(staged) == {}
    assert ticks.gaps([row.tick for row in staged], every_s=3.0) == []
    late = [(row.staged_at - row.tick).total_seconds() for row in staged]
    print(f"\nstaged after the tick (s): {[round(s, 3) for s in late]}")
    assert max(late) < 1.0, late
    assert min(late) >= 0.0


def test_a_role_that_may_not_stage_ticks_is_logged_once_and_forwarding_goes_on(
    settings: config.Settings, database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A drain role without INSERT on the table (the least-privilege role of a drain with no
    schedules) must not stop forwarding when a schedule is added: the error is logged once."""
    role = f"drain_noins_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
        conn.execute(f'GRANT SELECT, UPDATE, DELETE ON staged_jobs TO "{role}"')
        conn.execute(f'GRANT SELECT, INSERT, DELETE ON staged_jobs_dead TO "{role}"')
        conn.execute(f'GRANT SELECT, INSERT, UPDATE ON staged_jobs_schedules TO "{role}"')
        conn.execute(f'GRANT SELECT ON staged_jobs_versions TO "{role}"')
        drain_ids = [str(job_id) for job_id in _stage_three(conn)]
    memory = testing.MemoryAdapter("default")
    as_role = dataclasses.replace(settings, dsn=database.replace("postgres@", f"{role}@"))
    the_relay = relay.Relay(make_settings(as_role, every_second()), {"default": memory})
    try:
        with caplog.at_level(logging.ERROR, logger="drain.relay.schedules"):

            def refused() -> list[logging.LogRecord]:
                the_relay.turn()  # forwards, and stages a tick once one falls due (every second)
                return [r for r in caplog.records if "may not write them" in r.message]

            wait_until("the scheduler's refusal to be logged", refused, 30)
            for _ in range(5):
                the_relay.turn()
        assert the_relay.leadership.is_leader
        assert sorted(str(job.job_id) for job in memory.published) == sorted(drain_ids)
        refused = [r for r in caplog.records if "may not write them" in r.message]
        assert len(refused) == 1
    finally:
        the_relay.shutdown()
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{role}"')
            conn.execute(f'DROP ROLE "{role}"')


def _stage_three(conn: psycopg.Connection[Any]) -> list[Any]:
    return [
        conn.execute("INSERT INTO staged_jobs (job_name) VALUES ('app.tasks.t') RETURNING job_id").fetchone()[
            0
        ]  # type: ignore[index]
        for _ in range(3)
    ]
