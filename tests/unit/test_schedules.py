"""Schedules without a database: cron ticks in a timezone (DST), catch-up plans, tick job ids."""

from __future__ import annotations

import contextlib
import datetime
import time
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drain import config
from drain.config import cron
from drain.relay import schedules
from drain.store import sql

UTC = datetime.UTC
BERLIN = cron.timezone("Europe/Berlin")
NEW_YORK = cron.timezone("America/New_York")


def at(*parts: int, tz: datetime.tzinfo = UTC, fold: int = 0) -> datetime.datetime:
    return datetime.datetime(*parts, tzinfo=tz, fold=fold).astimezone(UTC)  # type: ignore[misc]


def schedule(**fields: object) -> config.ScheduleSettings:
    base: dict[str, object] = {"name": "s", "cron": "* * * * * *", "job_name": "app.tasks.tick"}
    base.update(fields)
    return config.ScheduleSettings(**base)  # type: ignore[arg-type]


# --- DST: Debian cron's behaviour ------------------------------------------------------------


def test_spring_forward_fixed_time_in_the_gap_runs_once_right_after_the_change() -> None:
    # 2026-03-29 in Berlin: 02:00 jumps to 03:00; 02:30 does not exist that night.
    daily = cron.Cron("30 2 * * *", "Europe/Berlin")
    ticks = list(daily.ticks(at(2026, 3, 28, 12, 0), at(2026, 3, 30, 12, 0)))
    assert ticks == [at(2026, 3, 29, 3, 0, tz=BERLIN), at(2026, 3, 30, 2, 30, tz=BERLIN)]


def test_fall_back_fixed_time_in_the_repeated_hour_runs_once() -> None:
    # 2026-10-25 in Berlin: 03:00 goes back to 02:00; 02:30 happens twice, the job runs once.
    daily = cron.Cron("30 2 * * *", "Europe/Berlin")
    ticks = list(daily.ticks(at(2026, 10, 24, 12, 0), at(2026, 10, 26, 12, 0)))
    assert ticks == [at(2026, 10, 25, 2, 30, tz=BERLIN), at(2026, 10, 26, 2, 30, tz=BERLIN)]


def test_fall_back_hourly_job_runs_in_both_copies_of_the_hour() -> None:
    hourly = cron.Cron("30 * * * *", "Europe/Berlin")
    ticks = list(hourly.ticks(at(2026, 10, 25, 0, 0, tz=BERLIN), at(2026, 10, 25, 4, 0, tz=BERLIN)))
    assert ticks == [
        at(2026, 10, 25, 0, 30, tz=BERLIN),
        at(2026, 10, 25, 1, 30, tz=BERLIN),
        at(2026, 10, 25, 2, 30, tz=BERLIN, fold=0),
        at(2026, 10, 25, 2, 30, tz=BERLIN, fold=1),
        at(2026, 10, 25, 3, 30, tz=BERLIN),
    ]
    assert len(set(ticks)) == 5  # distinct instants, an hour apart


def test_spring_forward_in_new_york() -> None:
    # 2026-03-08: 02:00 jumps to 03:00 in New York.
    daily = cron.Cron("15 2 * * *", "America/New_York")
    (tick,) = daily.ticks(at(2026, 3, 8, 0, 0, tz=NEW_YORK), at(2026, 3, 8, 12, 0, tz=NEW_YORK))
    assert tick == at(2026, 3, 8, 3, 0, tz=NEW_YORK)


def test_ticks_are_utc_and_in_the_schedule_timezone() -> None:
    daily = cron.Cron("0 9 * * *", "Europe/Berlin")
    tick = daily.next_after(at(2026, 1, 10, 0, 0))
    assert tick == at(2026, 1, 10, 8, 0)  # 09:00 CET is 08:00 UTC
    assert tick is not None and tick.utcoffset() == datetime.timedelta(0)


@pytest.mark.parametrize(
    ("expression", "tz", "fragment"),
    [
        ("", "UTC", "empty"),
        ("61 * * * *", "UTC", "not valid"),
        ("* * * *", "UTC", "not valid"),
        ("0 0 30 2 *", "UTC", "not valid"),
        ("* * * * * * *", "UTC", "not valid"),
        ("x" * 1000, "UTC", "not valid"),
        ("* * * * *\x00", "UTC", "not valid"),
        ("* * * * *", "Mars/Olympus", "unknown timezone"),
        ("* * * * *", "../../etc/passwd", "unknown timezone"),
        ("* * * * *", "", "unknown timezone"),
        ("* * * * *", "UTC\x00", "unknown timezone"),
    ],
)
def test_bad_expressions_and_timezones_are_refused_in_one_line(
    expression: str, tz: str, fragment: str
) -> None:
    with pytest.raises(cron.CronError, match=fragment) as caught:
        cron.Cron(expression, tz)
    assert "\n" not in str(caught.value)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_any_text_is_a_cron_or_a_cron_error(text: str) -> None:
    with contextlib.suppress(cron.CronError):
        cron.Cron(text)


# --- the most recent ticks -----------------------------------------------------------------


def test_recent_keeps_the_latest_ticks_and_says_older_were_left_out() -> None:
    every_second = cron.Cron("* * * * * *")
    start = at(2026, 1, 1, 0, 0)
    ticks, skipped = every_second.recent(start, start + datetime.timedelta(seconds=10), 3)
    assert ticks == [start + datetime.timedelta(seconds=s) for s in (8, 9, 10)]
    assert skipped
    ticks, skipped = every_second.recent(start, start + datetime.timedelta(seconds=3), 5)
    assert ticks == [start + datetime.timedelta(seconds=s) for s in (1, 2, 3)]
    assert not skipped


def test_recent_after_a_year_long_outage_is_quick() -> None:
    every_second = cron.Cron("* * * * * *")
    start = at(2025, 1, 1, 0, 0)
    began = time.perf_counter()
    ticks, skipped = every_second.recent(start, start + datetime.timedelta(days=400), 100)
    assert len(ticks) == 100 and skipped
    assert ticks[-1] == start + datetime.timedelta(days=400)
    assert time.perf_counter() - began < 5.0  # walks an hour of seconds, not 400 days of them


def test_recent_of_a_rare_schedule_walks_from_the_last_tick() -> None:
    yearly = cron.Cron("0 0 1 1 *")
    ticks, skipped = yearly.recent(at(2020, 6, 1, 0, 0), at(2026, 6, 1, 0, 0), 100)
    assert ticks == [at(year, 1, 1, 0, 0) for year in range(2021, 2027)]
    assert not skipped


# --- catch-up plans ------------------------------------------------------------------------

LAST = at(2026, 5, 1, 12, 0, 0)
NOW = LAST + datetime.timedelta(seconds=5, milliseconds=300)  # five ticks fell due meanwhile


def test_a_new_schedule_starts_at_now_and_stages_nothing() -> None:
    step = schedules.plan(schedule(), None, NOW, term_start=True)
    assert step.ticks == [] and step.last_tick == NOW


@pytest.mark.parametrize(
    ("catch_up", "staged"),
    [("all", 5), ("latest", 1), ("none", 0)],
)
def test_catch_up_applies_to_ticks_missed_before_the_term(catch_up: str, staged: int) -> None:
    step = schedules.plan(schedule(catch_up=catch_up), LAST, NOW, term_start=True)
    assert len(step.ticks) == staged
    assert step.last_tick == (step.ticks[-1] if step.ticks else NOW)
    if step.ticks:
        assert step.ticks[-1] == LAST + datetime.timedelta(seconds=5)


@pytest.mark.parametrize("catch_up", ["all", "latest", "none"])
def test_within_a_term_every_tick_is_staged(catch_up: str) -> None:
    step = schedules.plan(schedule(catch_up=catch_up), LAST, NOW, term_start=False)
    assert step.ticks == [LAST + datetime.timedelta(seconds=s) for s in range(1, 6)]


def test_catch_up_all_is_capped() -> None:
    step = schedules.plan(schedule(catch_up="all", catch_up_max=2), LAST, NOW, term_start=True)
    assert step.ticks == [LAST + datetime.timedelta(seconds=s) for s in (4, 5)]
    assert step.skipped


def test_nothing_due_leaves_the_row_alone() -> None:
    step = schedules.plan(schedule(cron="0 0 * * *"), LAST, NOW, term_start=True)
    assert step == schedules.Plan([], None, False)


def test_a_last_tick_in_the_future_stages_nothing() -> None:
    # The database clock went back (a failover to a skewed replica): never a tick twice.
    step = schedules.plan(schedule(), NOW, LAST, term_start=False)
    assert step.ticks == [] and step.last_tick is None


# --- what a tick's job carries -------------------------------------------------------------


def test_tick_job_id_is_pinned_and_depends_on_table_schedule_and_instant() -> None:
    names = sql.Names("public", "staged_jobs")
    job_id = schedules.tick_job_id(names, "nightly", at(2026, 1, 1, 3, 0))
    assert job_id == uuid.uuid5(
        schedules.TICK_NAMESPACE, '"public"."staged_jobs"\x00nightly\x002026-01-01T03:00:00+00:00'
    )
    assert job_id == schedules.tick_job_id(names, "nightly", at(2026, 1, 1, 4, 0, tz=BERLIN))
    assert job_id != schedules.tick_job_id(names, "nightly", at(2026, 1, 1, 3, 1))
    assert job_id != schedules.tick_job_id(names, "weekly", at(2026, 1, 1, 3, 0))
    assert job_id != schedules.tick_job_id(sql.Names("public", "other"), "nightly", at(2026, 1, 1, 3, 0))


@pytest.mark.parametrize(("backend_type", "key"), [("rq", "meta"), ("rabbitmq", "headers")])
def test_tick_options_carry_the_schedule_and_tick_where_the_backend_passes_them(
    backend_type: str, key: str
) -> None:
    tick = at(2026, 1, 1, 3, 0)
    options = schedules.tick_options(schedule(options={key: {"mine": 1}, "other": 2}), backend_type, tick)
    assert options == {
        key: {"mine": 1, "drain_schedule": "s", "drain_tick": "2026-01-01T03:00:00+00:00"},
        "other": 2,
    }


def test_tick_options_leave_an_unknown_backend_type_alone() -> None:
    assert schedules.tick_options(schedule(options={"x": 1}), "celery", at(2026, 1, 1)) == {"x": 1}
