"""Lanes an operator can see: `drain status` names who leads which lane and each lane's backlog
and lag; the metrics say how many lanes each drain leads, which, and (from lane 0's leader) each
lane's due rows and lag. Real Postgres, drains in this process (memory backends)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import psycopg
import pytest

from drain import config, testing
from drain.cli.commands import status
from drain.observability import metrics
from drain.relay import lanes as lanes_mod
from drain.relay import loop as relay
from drain.store import session as store
from tests.conftest import ManualClock
from tests.support import configs, processes
from tests.support.waiting import wait_until

LANES = 8
LANE_OF = "mod(hashtext(coalesce(ordering_key, job_id::text)) & 2147483647, %s)"
"""A row's lane, written out here rather than taken from queries.sql: the test's own reckoning."""


def members(settings: config.Settings, count: int, clock: ManualClock) -> list[relay.Relay]:
    tuned = dataclasses.replace(
        settings, lanes=LANES, backends={"default": config.BackendSettings("default", "memory", 3, {})}
    )
    return [
        relay.Relay(tuned, {"default": testing.MemoryAdapter()}, clock=clock, jitter=lambda: 0.5)
        for _ in range(count)
    ]


@pytest.fixture
def three(settings: config.Settings, clock: ManualClock) -> Iterator[list[relay.Relay]]:
    """Three members, balanced: 3/3/2 lanes."""
    relays = members(settings, 3, clock)
    try:
        for _ in range(6):
            for each in relays:
                each.turn()
            clock.advance(1.0)
        assert sorted(len(led(each)) for each in relays) == [2, 3, 3]
        yield relays
    finally:
        for each in relays:
            each.shutdown()


def led(the_relay: relay.Relay) -> set[int]:
    assert isinstance(the_relay.leadership, lanes_mod.Lanes)
    return set(the_relay.leadership.led)


def report(settings: config.Settings, lanes: int = LANES) -> dict[str, Any]:
    """What `drain status --json` reports, read on a session of its own."""
    db = store.Store(dataclasses.replace(settings, lanes=lanes))
    try:
        return status._report(db)
    finally:
        db.close()


def stage_deferred(dsn: str, rows: int, keys: int) -> None:
    """``rows`` keyed rows whose run_at passed a minute ago: due, and out of the members' reach
    until they look (the members here never turn again)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (job_name, ordering_key, run_at) "
            "SELECT 'job', 'k' || (i %% %s), now() - interval '1 minute' FROM generate_series(1, %s) AS i",
            (keys, rows),
        )


def lane_counts(dsn: str) -> dict[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            f"SELECT {LANE_OF} AS lane, count(*) FROM staged_jobs GROUP BY 1", (LANES,)
        ).fetchall()
    return {int(lane): int(count) for lane, count in found}


# --- drain status -----------------------------------------------------------------------------


def test_status_names_each_lanes_leader_and_no_single_leader(
    settings: config.Settings, three: list[relay.Relay]
) -> None:
    """Before lanes were operable, status took one member (any holder of the leader lock, which
    members hold shared) for "the leader" and called the others standbys."""
    found = report(settings)
    assert found["leader"] is None
    assert found["standbys"] == []
    laned = found["lanes"]
    assert isinstance(laned, dict)
    assert laned["count"] == LANES and laned["counts_running"] == [LANES]
    by_backend = {member["backend_pid"]: set(member["led"]) for member in laned["members"]}
    assert by_backend == {each.leadership.pid: led(each) for each in three}
    for lane in laned["by_lane"]:
        (owner,) = [each for each in three if lane["lane"] in led(each)]
        assert lane["backend_pid"] == owner.leadership.pid
        assert lane["leader"] is not None and lane["leader"].startswith(f"{os.getpid()}@")


def test_status_counts_each_lanes_due_rows_and_lag(settings: config.Settings, database: str) -> None:
    """Every lane's due rows as the test reckons the lanes; one key staged long ago lags its lane
    only. Nobody leads: every lane shows no leader."""
    stage_deferred(database, 200, keys=50)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (job_name, ordering_key, created_at) "
            "VALUES ('job', 'late', now() - interval '1 hour')"
        )
        (late,) = conn.execute(
            f"SELECT {LANE_OF} FROM staged_jobs WHERE ordering_key = 'late'", (LANES,)
        ).fetchone()  # type: ignore[misc]
    found = report(settings)
    laned = found["lanes"]
    assert isinstance(laned, dict)
    expected = lane_counts(database)
    assert {lane["lane"]: lane["due"] for lane in laned["by_lane"]} == {
        lane: expected.get(lane, 0) for lane in range(LANES)
    }
    assert sum(lane["due"] for lane in laned["by_lane"]) == found["due"] == 201
    ages = {lane["lane"]: lane["oldest_due_age_s"] for lane in laned["by_lane"]}
    assert 3500 < ages[late] < 4000, ages
    assert all(50 < age < 300 for lane, age in ages.items() if lane != late and expected.get(lane)), ages
    assert all(lane["leader"] is None for lane in laned["by_lane"])
    assert laned["members"] == [] and not laned["capped"]

    text = io.StringIO()
    with redirect_stdout(text):
        status._print_text(found)
    shown = text.getvalue()
    assert "lanes    8, members 0, lanes led none" in shown
    assert f"lane {late:<3} leader NONE, {expected[late]} due, lag " in shown


def test_the_lane_backlog_is_capped_per_branch(settings: config.Settings, database: str) -> None:
    stage_deferred(database, 30, keys=30)
    db = store.Store(settings)
    try:
        capped = lanes_mod.backlog(db, LANES, 10)
        exact = lanes_mod.backlog(db, LANES, None)
    finally:
        db.close()
    assert capped.capped and sum(lane.due for lane in capped.lanes) == 10
    assert not exact.capped and sum(lane.due for lane in exact.lanes) == 30


def test_status_text_shows_the_shares_and_the_members(
    settings: config.Settings, three: list[relay.Relay]
) -> None:
    text = io.StringIO()
    with redirect_stdout(text):
        status._print_text(report(settings))
    shown = text.getvalue()
    shares = "/".join(str(len(led(each))) for each in sorted(three, key=lambda r: r.leadership.pid or 0))
    assert f"lanes    8, members 3, lanes led {shares}" in shown, shown
    assert shown.count("  member   ") == 3
    assert "leader   none: 3 member(s) lead the lanes" in shown
    assert "lanes    8 more led, nothing due" in shown


def test_status_run_without_the_lanes_setting_still_sees_the_lanes(
    settings: config.Settings, three: list[relay.Relay]
) -> None:
    """An operator's `drain status` with a config that leaves lanes at 1 reads the count the
    members run with."""
    found = report(settings, lanes=1)
    assert found["lanes"] is not None and found["lanes"]["count"] == LANES
    assert found["leader"] is None


def test_status_of_one_lane_shows_no_lanes(settings: config.Settings, database: str) -> None:
    the_relay = relay.Relay(
        dataclasses.replace(
            settings, backends={"default": config.BackendSettings("default", "memory", 3, {})}
        ),
        {"default": testing.MemoryAdapter()},
    )
    try:
        assert the_relay.leadership.try_acquire()
        found = report(settings, lanes=1)
        assert found["lanes"] is None
        assert found["leader"] is not None and found["leader"]["backend_pid"] == the_relay.leadership.pid
    finally:
        the_relay.shutdown()


# --- metrics ----------------------------------------------------------------------------------


def sample(the_relay: relay.Relay, name: str, labels: dict[str, str] | None = None) -> float | None:
    return the_relay.metrics.registry.get_sample_value(name, labels or {})


def test_metrics_say_how_many_lanes_and_which_each_drain_leads(three: list[relay.Relay]) -> None:
    for each in three:
        assert sample(each, "drain_lanes") == LANES
        assert sample(each, "drain_lanes_led") == len(led(each))
        assert sample(each, "drain_leader") == 1
    for lane in range(LANES):
        flags = [sample(each, "drain_lane_led", {"lane": str(lane)}) for each in three]
        assert sorted(flags) == [0, 0, 1], f"lane {lane}: one leader, each other drain 0"


def test_lane_zeros_leader_exports_each_lanes_figures(
    settings: config.Settings, database: str, three: list[relay.Relay]
) -> None:
    stage_deferred(database, 100, keys=40)
    expected = lane_counts(database)
    for each in three:
        each.refresh_figures(force=True)
    (first,) = [each for each in three if 0 in led(each)]
    for lane in range(LANES):
        assert sample(first, "drain_lane_due_jobs", {"lane": str(lane)}) == expected.get(lane, 0)
        age = sample(first, "drain_lane_oldest_due_age_seconds", {"lane": str(lane)})
        assert age is not None and (age > 50 if expected.get(lane) else age == 0)
    for each in three:
        assert sample(each, "drain_due_jobs") == 100, "every member exports the table's figures"
        if each is not first:
            assert sample(each, "drain_lane_due_jobs", {"lane": "0"}) is None


def test_with_one_lane_lane_zero_is_the_table(settings: config.Settings) -> None:
    """drain_lanes_led and drain_lane_led{lane="0"} follow the lead with one lane; no other lane
    and no per-lane figures are exported."""
    the_relay = relay.Relay(
        dataclasses.replace(
            settings, backends={"default": config.BackendSettings("default", "memory", 3, {})}
        ),
        {"default": testing.MemoryAdapter()},
    )
    try:
        assert sample(the_relay, "drain_lanes") == 1
        assert sample(the_relay, "drain_lane_led", {"lane": "0"}) == 0
        the_relay.turn()
        assert sample(the_relay, "drain_leader") == 1 and sample(the_relay, "drain_lanes_led") == 1
        assert sample(the_relay, "drain_lane_led", {"lane": "0"}) == 1
        the_relay.refresh_figures(force=True)
        lanes_seen = {
            (family.name, tuple(s.labels.items()))
            for family in the_relay.metrics.registry.collect()
            if family.name.startswith("drain_lane_")
            for s in family.samples
        }
        assert lanes_seen == {("drain_lane_led", (("lane", "0"),))}
    finally:
        the_relay.shutdown()
    assert sample(the_relay, "drain_lanes_led") == 0
    assert sample(the_relay, "drain_lane_led", {"lane": "0"}) == 0


def test_metrics_names_are_bounded_by_max_lanes() -> None:
    found = metrics.Metrics()
    found.set_lanes(config.MAX_LANES, set(range(0, config.MAX_LANES, 3)))
    series = [
        s for family in found.registry.collect() if family.name == "drain_lane_led" for s in family.samples
    ]
    assert len(series) == config.MAX_LANES


# --- drain status, the command, against drain run processes --------------------------------------


def test_drain_status_with_three_drain_processes(database: str, tmp_path: Path) -> None:
    """Three `drain run` processes with lanes = 8: status names the three members, the lanes each
    leads (3/3/2 once balanced), a leader for every lane, and no standby."""
    cfg = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.memory()}, lanes=LANES, standby_retry_s=0.2
    )
    started = [processes.start_drain(cfg, None, tmp_path / f"drain{i}.log") for i in range(3)]
    with processes.running(*started):
        found: dict[str, Any] = {}

        def balanced() -> bool:
            nonlocal found
            done = processes.drain_cli("status", "--json", "--config", str(cfg), dsn=database)
            found = json.loads(done.stdout)
            laned = found["lanes"]
            return isinstance(laned, dict) and sorted(len(m["led"]) for m in laned["members"]) == [2, 3, 3]

        wait_until("three members with 3/3/2 lanes in drain status", balanced, 60)
        laned = found["lanes"]
        assert isinstance(laned, dict)
        assert {m["process_id"] for m in laned["members"]} == {p.pid for p in started}
        assert all(lane["leader"] is not None for lane in laned["by_lane"])
        assert found["leader"] is None and found["standbys"] == []
        human: subprocess.CompletedProcess[str] = processes.drain_cli(
            "status", "--config", str(cfg), dsn=database
        )
        assert "members 3, lanes led " in human.stdout, human.stdout
        for each in started:
            assert f"member   {each.pid}@" in human.stdout


# --- the console ------------------------------------------------------------------------------


def test_the_consoles_overview_shows_the_members_and_their_lanes(
    settings: config.Settings, database: str, three: list[relay.Relay], tmp_path: Path
) -> None:
    """Before, the console named the first holder of the leader lock (a member, holding it shared)
    the leader and the other members standbys; then, with the leader query taking the exclusive
    holder only, "No drain leads this table"."""
    pytest.importorskip("uvicorn")
    from tests.support import console

    with console.running(database, tmp_path) as site:
        page = site.get("/").body
    assert "No drain leads this table" not in page
    assert page.count('<tr class="member">') == 3
    for each in three:
        shown = ",".join(map(str, sorted(led(each))))
        assert f"member, leads lanes {shown} of 8" in page
    assert "<td>standby</td>" not in page
