"""Schedules through the real ``drain`` command: two drains started together, ``drain schedules``,
``drain check``."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg

from tests.support import configs, processes, ticks
from tests.support.waiting import wait_until

SCHEDULES = """
[[schedules]]
name = "every-second"
cron = "* * * * * *"
job_name = "app.tasks.tick"
catch_up = "all"

[[schedules]]
name = "nightly"
cron = "30 2 * * *"
job_name = "app.tasks.nightly"
timezone = "Europe/Berlin"
"""


def write_config(path: Path, dsn: str, schedules: str = SCHEDULES) -> Path:
    return configs.write_config(path, dsn, {"default": configs.memory()}, extra_toml=schedules)


def test_two_drains_started_at_the_same_moment_stage_no_tick_twice(database: str, tmp_path: Path) -> None:
    ticks.install(database)
    config = write_config(tmp_path / "drain.toml", database)
    drains = [
        processes.start_drain(
            config, processes.with_application_name(database, name), tmp_path / f"{name}.log"
        )
        for name in ("drain-a", "drain-b")
    ]
    with processes.running(*drains):
        wait_until("six ticks staged", lambda: len(ticks.staged(database, "every-second")) >= 6, 30)
        assert all(drain.alive() for drain in drains)
    staged = ticks.staged(database, "every-second")
    assert ticks.duplicates(staged) == {}
    assert ticks.gaps([row.tick for row in staged]) == []
    assert len({row.pid for row in staged}) == 1  # one leader staged them all


def test_drain_schedules_lists_last_and_next_ticks_and_removed_ones(database: str, tmp_path: Path) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs_schedules (name, cron, timezone, last_tick) VALUES "
            "('every-second', '* * * * * *', 'UTC', now() - interval '1 hour'), "
            "('gone', '0 * * * *', 'UTC', '2026-01-01T00:00:00Z')"
        )
    config = write_config(tmp_path / "drain.toml", database)
    done = processes.drain_cli("schedules", "--json", "--config", str(config), dsn=database)
    assert done.returncode == 0, done.stderr
    listed = {entry["name"]: entry for entry in json.loads(done.stdout)}
    assert set(listed) == {"every-second", "nightly", "gone"}
    assert listed["gone"]["configured"] is False
    assert listed["gone"]["last_tick"] == "2026-01-01T00:00:00+00:00"
    assert listed["gone"]["next_tick"] is None
    assert listed["nightly"]["last_tick"] is None  # never seen by a leader yet
    assert listed["nightly"]["next_tick"] is not None
    assert listed["nightly"]["timezone"] == "Europe/Berlin"
    # overdue (no drain was leading): due now, the leader's next pass applies catch_up
    assert listed["every-second"]["next_tick"] >= listed["every-second"]["last_tick"]
    text = processes.drain_cli("schedules", "--config", str(config), dsn=database)
    assert text.returncode == 0, text.stderr
    expected = "gone\t0 * * * *\tUTC\tlast 2026-01-01T00:00:00+00:00\tnext -\t(removed from the config)"
    assert expected in text.stdout


def test_drain_check_names_the_schedule_with_a_bad_cron_or_timezone(database: str, tmp_path: Path) -> None:
    bad = """
[[schedules]]
name = "broken-cron"
cron = "* * 32 * *"
job_name = "app.tasks.a"

[[schedules]]
name = "broken-zone"
cron = "* * * * *"
job_name = "app.tasks.b"
timezone = "Europe/Atlantis"
"""
    config = write_config(tmp_path / "drain.toml", database, bad)
    done = processes.drain_cli("check", "--config", str(config), dsn=database)
    assert done.returncode == 2, done.stdout
    assert "schedules.broken-cron.cron: the cron expression '* * 32 * *' is not valid" in done.stderr
    assert "schedules.broken-zone.timezone: unknown timezone 'Europe/Atlantis'" in done.stderr
    assert "Traceback" not in done.stderr


def test_drain_check_reports_a_missing_schedules_table(database: str, tmp_path: Path) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("DROP TABLE staged_jobs_schedules")
    config = write_config(tmp_path / "drain.toml", database)
    done = processes.drain_cli("check", "--config", str(config), dsn=database)
    assert done.returncode == 3, done.stdout
    assert "schedules: table staged_jobs_schedules does not exist; run `drain migrate`" in done.stderr
    migrated = processes.drain_cli("migrate", "--config", str(config), dsn=database)
    assert migrated.returncode == 0, migrated.stderr
    assert processes.drain_cli("check", "--config", str(config), dsn=database).returncode == 0
