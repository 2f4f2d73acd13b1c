"""Schedules across failovers: three schedules tick every second for about a minute while the
leader is SIGKILLed twice and a standby takes over each time; the second time no drain leads for
five seconds (the remaining standby is frozen with SIGSTOP while the leader dies).

- catch_up = "all": every tick staged exactly once, no gap, across both failovers.
- catch_up = "latest": of the ticks that fell due in the 5-second outage, exactly one (the most
  recent) is staged by the new leader.
- catch_up = "none": none of them.

The ticks are counted by a trigger (tests.support.ticks) in the staging transactions themselves,
so a pass rolled back by the kill counts nothing.
"""

from __future__ import annotations

import datetime
import signal
from pathlib import Path

import psycopg
import pytest

from tests.support import configs, faultload, processes, ticks
from tests.support.waiting import wait_until

OUTAGE_S = 5.0
PHASE_TICKS = 18  # ticks each leader stages before it is killed (or before the test ends)

SCHEDULES = "".join(
    f'\n[[schedules]]\nname = "{mode}"\ncron = "* * * * * *"\njob_name = "app.tasks.{mode}"\n'
    f'catch_up = "{mode}"\n'
    for mode in ("all", "latest", "none")
)


def write_config(path: Path, dsn: str) -> Path:
    return configs.write_config(path, dsn, {"default": configs.memory()}, extra_toml=SCHEDULES)


def leader_name(dsn: str) -> str | None:
    pid = faultload.leader_pid(dsn)
    if pid is None:
        return None
    name = faultload.scalar(dsn, "SELECT application_name FROM pg_stat_activity WHERE pid = %s", [pid])
    return None if name is None else str(name)


def staged_by(dsn: str, pid: int, mode: str = "all") -> list[ticks.Staged]:
    return [row for row in ticks.staged(dsn, mode) if row.pid == pid]


@pytest.mark.slow
def test_every_tick_once_across_two_failovers_and_catch_up_after_an_outage(
    database: str, tmp_path: Path
) -> None:
    ticks.install(database)

    def start(name: str) -> processes.Process:
        config = write_config(tmp_path / f"{name}.toml", processes.with_application_name(database, name))
        return processes.start_drain(config, None, tmp_path / f"{name}.log")

    drains = {"drain-a": start("drain-a")}
    with processes.running(drains["drain-a"]):
        # drain-a leads first; the standbys start once it does
        first = wait_until(
            "drain-a to lead",
            lambda: leader_name(database) == "drain-a" and faultload.leader_pid(database),
            faultload.DEADLINE_S,
        )
        drains.update({name: start(name) for name in ("drain-b", "drain-c")})
        with processes.running(drains["drain-b"], drains["drain-c"]):
            leaders = failovers(database, drains, first)
    check(database, *leaders)


def failovers(
    database: str, drains: dict[str, processes.Process], first: int
) -> tuple[int, tuple[int, str], tuple[int, str]]:
    """Kill the leader twice; return the three leaders' session pids (and the later two's names)."""
    wait_until(
        "drain-a's ticks", lambda: len(staged_by(database, first)) >= PHASE_TICKS, faultload.DEADLINE_S
    )
    assert not drains["drain-b"].popen.poll() and not drains["drain-c"].popen.poll()

    # failover 1: SIGKILL the leader, a standby takes over at once
    drains["drain-a"].signal(signal.SIGKILL)
    second_name = wait_until(
        "a new leader",
        lambda: (name := leader_name(database)) not in (None, "drain-a") and name,
        faultload.DEADLINE_S,
    )
    second = faultload.leader_pid(database)
    assert second is not None
    wait_until(
        "the second leader's ticks",
        lambda: len(staged_by(database, second)) >= PHASE_TICKS,
        faultload.DEADLINE_S,
    )

    # failover 2: freeze the last standby, SIGKILL the leader, let 5 s pass with no leader
    third_name = "drain-c" if second_name == "drain-b" else "drain-b"
    drains[third_name].signal(signal.SIGSTOP)
    wait_until("the standby frozen", drains[third_name].stopped, faultload.DEADLINE_S)
    drains[second_name].signal(signal.SIGKILL)
    killed_at = ticks.db_now(database)
    wait_until(
        "a 5-second outage",
        lambda: (ticks.db_now(database) - killed_at).total_seconds() >= OUTAGE_S,
        faultload.DEADLINE_S,
    )
    assert faultload.leader_pid(database) is None
    drains[third_name].signal(signal.SIGCONT)
    wait_until("the standby to take over", lambda: leader_name(database) == third_name, faultload.DEADLINE_S)
    third = faultload.leader_pid(database)
    assert third is not None
    wait_until(
        "the third leader's ticks",
        lambda: len(staged_by(database, third)) >= PHASE_TICKS,
        faultload.DEADLINE_S,
    )
    return first, (second, second_name), (third, third_name)


def check(database: str, first: int, second_leader: tuple[int, str], third_leader: tuple[int, str]) -> None:
    (second, second_name), (third, third_name) = second_leader, third_leader
    every = {mode: ticks.staged(database, mode) for mode in ("all", "latest", "none")}
    for mode, rows in every.items():
        assert ticks.duplicates(rows) == {}, mode
    all_ticks = sorted(row.tick for row in every["all"])
    assert ticks.gaps(all_ticks) == [], "catch_up=all staged every tick across both failovers"
    assert {row.pid for row in every["all"]} == {first, second, third}

    # The outage: the ticks after the second leader's last one, staged by the third leader's
    # first pass (catch_up = all stages them together, late, in one transaction).
    last_before = max(row.tick for row in every["all"] if row.pid == second)
    third_rows = [row for row in every["all"] if row.pid == third]
    first_pass_at = min(row.staged_at for row in third_rows)
    missed = sorted(row.tick for row in third_rows if row.staged_at == first_pass_at)
    assert missed[0] == last_before + datetime.timedelta(seconds=1)
    assert len(missed) >= OUTAGE_S - 1, missed
    window = (last_before, missed[-1])

    def in_window(mode: str) -> list[datetime.datetime]:
        return sorted(row.tick for row in every[mode] if window[0] < row.tick <= window[1])

    assert in_window("latest") == [missed[-1]], "latest: exactly one catch-up job, the most recent tick"
    assert in_window("none") == [], "none: no catch-up job"
    for mode in ("latest", "none"):
        ticks_ = {row.tick for row in every[mode]}
        assert ticks_ <= set(all_ticks), mode
        after = {tick for tick in all_ticks if tick > window[1]}
        assert after <= ticks_, f"{mode}: every tick after the catch-up"
    with psycopg.connect(database) as conn:
        rows = conn.execute("SELECT name, last_tick FROM staged_jobs_schedules ORDER BY name").fetchall()
    assert [name for name, _ in rows] == ["all", "latest", "none"]
    print(
        f"\nschedule failover: {len(all_ticks)} ticks, leaders a→{second_name}→{third_name}, "
        f"outage ticks {len(missed)} (latest staged 1, none staged 0)"
    )
