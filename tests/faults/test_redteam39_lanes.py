"""Red team 39: lanes (drain.relay.lanes) against the guarantees, with lanes > 1.

Each test drives drains in-process (tests/relay/test_lanes.py's helpers, a ManualClock) and
counts what reached the broker or who holds which lock.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import threading
import time
import urllib.parse
from pathlib import Path

import psycopg
import pytest

from drain import __version__, config, errors, testing
from drain.console import figures
from drain.relay import lanes as lanes_mod
from drain.relay import leadership, pacing
from drain.relay import loop as relay
from drain.store import connection, identity
from drain.store import session as store
from tests.conftest import ManualClock
from tests.relay.test_lanes import LANES, drains, remaining, rounds, shares, stage, turns
from tests.support import pgbouncer


def published_in_key_order(published: list[object]) -> None:
    by_key: dict[str | None, list[int]] = {}
    for job in published:
        by_key.setdefault(job.ordering_key, []).append(job.args[0])  # type: ignore[attr-defined]
    for key, seen in by_key.items():
        assert seen == sorted(seen), f"{key} out of order: {seen}"


# --- what held ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("lanes", "members"), [(2, 3), (3, 2), (256, 3)])
def test_every_row_goes_once_whatever_the_lane_and_member_counts(
    settings: config.Settings, database: str, clock: ManualClock, lanes: int, members: int
) -> None:
    """More members than lanes (one leads none), fewer, and the largest count: every lane is led,
    every row forwarded once, per-key order kept; then a member leaves and its lanes are taken."""
    broker = testing.MemoryAdapter()
    relays = [r for r, _ in drains(settings, members, clock, lanes=lanes, adapter=broker)]
    try:
        rounds(relays, clock, 4)
        led = shares(relays)
        assert set().union(*led) == set(range(lanes)), "every lane is led"
        assert sum(len(s) for s in led) == lanes, "no lane led twice"
        stage(database, 300, keys=30)
        turns(relays, clock, 40, database)
        assert remaining(database) == 0
        relays[0].shutdown()
        stage(database, 300, keys=0)
        turns(relays[1:], clock, 40, database)
        assert remaining(database) == 0
        numbers = sorted(job.args[0] for job in broker.published)
        assert numbers == sorted(list(range(300)) * 2), "every row once"
        published_in_key_order([job for job in broker.published if job.ordering_key])
    finally:
        for each in relays:
            each.shutdown()


def test_every_key_is_in_exactly_one_lane_whatever_its_bytes(database: str) -> None:
    """The server's lane of odd keys (one byte, non-ASCII, 255 bytes, blank-edged, a hashtext of
    INT_MIN's neighbourhood) and of keyless rows: always in [0, N), for every count."""
    keys = ["a", "é", "日本語", "x" * 255, " k ", "0", "-1", "\u00a0", "k" * 100 + "é"]
    with psycopg.connect(database, autocommit=True) as conn:
        for count in (2, 3, 7, 8, 255, 256):
            rows = conn.execute(
                "SELECT k, mod(hashtext(k) & 2147483647, %s::int) FROM unnest(%s::text[]) AS k",
                (count, keys),
            ).fetchall()
            assert all(0 <= lane < count for _, lane in rows), rows
            row = conn.execute(
                "SELECT min(mod(hashtext(gen_random_uuid()::text) & 2147483647, %s::int)), "
                "max(mod(hashtext(gen_random_uuid()::text) & 2147483647, %s::int)) "
                "FROM generate_series(1, 5000)",
                (count, count),
            ).fetchone()
            assert row is not None and row[0] >= 0 and row[1] < count


def test_pipelined_flights_are_settled_before_their_lane_is_handed_over(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """pipeline_depth 2 on a pipelined adapter (its collect is the publish): drains join a
    backlog one by one and lanes move while batches are in flight; every row goes once, each key
    in order."""
    broker = testing.PipelinedMemoryAdapter()
    piped = dataclasses.replace(settings, pipeline_depth=2)
    stage(database, 600, keys=0)
    stage(database, 300, keys=25)
    relays = [r for r, _ in drains(piped, 3, clock, adapter=broker)]
    try:
        relays[0].turn()
        assert relays[0].in_flight > 0
        relays[0].turn()
        for joined in (2, 3):
            for _ in range(3):
                for each in relays[:joined]:
                    each.turn()
                clock.advance(1.0)
        turns(relays, clock, 80, database)
        for each in relays:
            each.settle_in_flight()
        assert remaining(database) == 0
        numbers = sorted(job.args[0] for job in broker.published)
        assert numbers == sorted([*range(600), *range(300)]), "every row once"
        published_in_key_order([job for job in broker.published if job.ordering_key])
    finally:
        for each in relays:
            each.shutdown()


def test_a_drain_of_one_lane_never_leads_beside_members(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """Members join and leave around a drain of one lane trying every turn: at no turn do both
    kinds lead."""
    single = relay.Relay(
        dataclasses.replace(
            settings, backends={"default": config.BackendSettings("default", "memory", 3, {})}
        ),
        {"default": testing.MemoryAdapter()},
        clock=clock,
    )
    members = [r for r, _ in drains(settings, 2, clock)]
    try:
        for step in range(12):
            order = [members[step % 2], single, members[(step + 1) % 2]]
            for each in order:
                each.turn()
                leading = [r for r in (single, *members) if r.leadership.is_leader]
                assert not (single.leadership.is_leader and len(leading) > 1), step
            if step == 4:
                members[0].shutdown()
                members[1].shutdown()
            if step == 8:
                single.shutdown()
            clock.advance(1.0)
    finally:
        for each in (single, *members):
            each.shutdown()


def test_the_lane_spaces_of_many_tables_are_distinct() -> None:
    """Two tables' lane locks (two int keys, objsubid 2, apart from every leader lock's objsubid
    1) meet only if their 31-bit spaces collide: none among 2,000 table names."""
    spaces = {lanes_mod.lane_space("public", f"t{n}") for n in range(2000)}
    assert len(spaces) == 2000


def test_the_member_that_cannot_arm_polls_and_a_row_in_its_lane_waits_no_longer(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """wakeup = notify, two idle members: one holds the wake lock and may sleep until its next
    balance; the other finds the lock taken and looks again within LOCKED_MAX_S, and its turn
    forwards a row of its lane staged meanwhile (the sleeper is woken by a notification it
    cannot act on)."""
    slow = dataclasses.replace(settings, poll_max_s=5.0, wakeup_poll_max_s=60.0, standby_retry_s=30.0)
    pairs = list(drains(slow, 2, clock))
    relays = [r for r, _ in pairs]
    try:
        for _ in range(3):
            for each in relays:
                each.turn()
            clock.advance(31.0)
        assert sorted(len(s) for s in shares(relays)) == [4, 4]
        waits = [[each.turn() for each in relays] for _ in range(6)][-1]
        armed = [each for each in relays if each.wakeup is not None and each.wakeup.armed]
        assert len(armed) == 1, waits
        (other,) = [each for each in relays if each not in armed]
        assert waits[relays.index(other)] <= pacing.LOCKED_MAX_S, waits
        other_lanes = sorted(getattr(other.leadership, "led", set()))
        stage(database, 200, keys=0)
        for _ in range(10):  # batches of 50; the sleeper does not turn
            other.turn()
        with psycopg.connect(database, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM staged_jobs WHERE mod(hashtext(job_id::text) & 2147483647, 8) "
                "= ANY(%s::int[])",
                (other_lanes,),
            ).fetchone()
        assert row == (0,), "the polling member forwarded its lanes' rows"
    finally:
        for each in relays:
            each.shutdown()


def takes_every_lane(member: relay.Relay, clock: ManualClock, deadline_s: float = 10.0) -> bool:
    """Turn ``member`` (its clock past each balance) until it leads all 8 lanes, or the deadline:
    a closed session's backend frees its locks a moment after the client closed it."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        clock.advance(1.0)
        member.turn()
        if shares([member]) == [set(range(LANES))]:
            return True
        time.sleep(0.02)
    return False


def test_a_release_that_fails_half_way_leaves_no_lane_held(
    settings: config.Settings, database: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shutdown's unlock of the first lane is cancelled (a statement that fails on a live
    session): the rest of the release is skipped, but closing the session frees every lane, and
    the other member takes all of them at its next balance."""
    pairs = list(drains(settings, 2, clock))
    first, second = (r for r, _ in pairs)
    try:
        rounds([first, second], clock, 3)
        assert sorted(len(s) for s in shares([first, second])) == [4, 4]
        real = first.store.unlock_lane

        def cancelled(space: int, lane: int, *, shared: bool = False) -> None:
            raise psycopg.errors.QueryCanceled("canceling statement due to user request")

        monkeypatch.setattr(first.store, "unlock_lane", cancelled)
        first.shutdown()
        monkeypatch.setattr(first.store, "unlock_lane", real)
        assert takes_every_lane(second, clock)
    finally:
        first.shutdown()
        second.shutdown()


def test_a_member_that_loses_one_lane_steps_down_and_frees_the_others(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """A lane lock lost behind a member's back fails its next batch (LeadershipLost); stepping
    down closes its session, so the lanes it still held are free at once (forget() leaves no lock
    on a live session), and it rejoins on a fresh one."""
    pairs = list(drains(settings, 2, clock))
    first, second = (r for r, _ in pairs)
    try:
        rounds([first, second], clock, 3)
        assert isinstance(first.leadership, lanes_mod.Lanes)
        lane = min(first.leadership.led)
        old_pid = first.leadership.pid
        first.store.unlock_lane(first.leadership.space, lane)
        first.turn()  # the fence fails: steps down
        assert not first.leadership.is_leader
        assert takes_every_lane(second, clock), "the lanes the old session held are freed"
        for _ in range(3):
            clock.advance(1.0)
            for each in (first, second):
                each.turn()
        assert sorted(len(s) for s in shares([first, second])) == [4, 4]
        assert first.leadership.pid != old_pid
    finally:
        first.shutdown()
        second.shutdown()


@pytest.mark.xfail(
    strict=True,
    reason="the reason is cleared by a committed step (Settler.committed) or stand_by(None); a "
    "drain that goes from the lanes blocker straight to leading an idle table keeps it at 1",
)
def test_the_lanes_reason_is_cleared_once_the_other_count_is_gone(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """drain_cannot_settle{reason="lanes"} is 1 while a drain of another count leads, and must be
    0 once this one leads. The drain of 8 stops; the drain of 4 takes every lane at its next try,
    straight from the blocker, and the table is idle: no step commits, and the gauge stays 1 (the
    DrainCannotSettle alert with it) for as long as nothing is staged."""
    ((eight, _),) = drains(settings, 1, clock, lanes=8)
    ((four, _),) = drains(settings, 1, clock, lanes=4)
    try:
        eight.turn()
        four.turn()
        gauge = {"reason": "lanes"}
        assert four.metrics.registry.get_sample_value("drain_cannot_settle", gauge) == 1.0
        eight.shutdown()
        clock.advance(1.0)
        four.turn()
        four.turn()
        assert four.leadership.is_leader
        assert four.metrics.registry.get_sample_value("drain_cannot_settle", gauge) == 0.0
    finally:
        eight.shutdown()
        four.shutdown()


def test_each_tick_is_staged_once_when_lane_zero_moves(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """A schedule every second (catch_up = "all"), two members: lane 0's leader stages ticks, stops;
    the other takes lane 0 at its next balance and stages on. Every second from the first tick to
    the last is staged once: none twice, none lost in the move."""
    every_second = config.ScheduleSettings(
        name="tick", cron="* * * * * *", job_name="app.tick", catch_up="all"
    )
    scheduled = dataclasses.replace(settings, schedules=(every_second,))
    broker = testing.MemoryAdapter()
    relays = [r for r, _ in drains(scheduled, 2, clock, adapter=broker)]
    try:
        rounds(relays, clock, 3)
        (zero,) = [each for each in relays if each.leadership.leads_schedules]
        (other,) = [each for each in relays if each is not zero]

        def turn_for(each: relay.Relay, seconds: float) -> None:
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                clock.advance(0.3)
                each.turn()
                time.sleep(0.05)

        turn_for(zero, 2.2)
        zero.shutdown()
        time.sleep(1.5)  # ticks fall due while lane 0 is free
        turn_for(other, 2.2)
        assert other.leadership.leads_schedules
        with psycopg.connect(database, autocommit=True) as conn:
            rows = conn.execute("SELECT options->>'drain_tick' FROM staged_jobs").fetchall()
        ticks = [job.tick for job in broker.published if job.tick] + [tick for (tick,) in rows]
        assert len(ticks) == len(set(ticks)), "a tick staged twice"
        instants = sorted(datetime.datetime.fromisoformat(tick) for tick in ticks)
        seconds = [(b - a).total_seconds() for a, b in itertools.pairwise(instants)]
        assert len(instants) >= 5 and set(seconds) == {1.0}, instants
    finally:
        for each in relays:
            each.shutdown()


class _Running:
    """A member running its loop in a thread, on the real clock, into a shared broker."""

    def __init__(self, settings: config.Settings, broker: testing.MemoryAdapter, lanes: int = LANES) -> None:
        tuned = dataclasses.replace(
            settings,
            lanes=lanes,
            batch_size=20,
            backends={"default": config.BackendSettings("default", "memory", 3, {})},
        )
        self.relay = relay.Relay(tuned, {"default": broker})
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.relay.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def end(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.mark.parametrize("depth", [0, 2])
def test_members_joining_and_leaving_under_load_publish_each_row_once_in_key_order(
    settings: config.Settings, database: str, depth: int
) -> None:
    """Three members in threads (real clock, balances every 0.2 s), one stopped and another
    started every second while rows are staged: every lane hand-over is a clean one, so every row
    reaches the shared broker exactly once, each key in staging order. Depth 2: a pipelined
    adapter (collect is the publish), batches in flight at every hand-over."""
    fast = dataclasses.replace(settings, standby_retry_s=0.2, poll_max_s=0.05, pipeline_depth=depth)
    broker = testing.PipelinedMemoryAdapter() if depth else testing.MemoryAdapter()
    running = [_Running(fast, broker) for _ in range(3)]
    try:
        for wave in range(6):
            with psycopg.connect(database, autocommit=True) as conn:
                conn.execute(
                    "INSERT INTO staged_jobs (job_name, job_args, ordering_key) "
                    "SELECT 'job', jsonb_build_array(%s * 1000 + i), 'k' || (i %% 17) "
                    "FROM generate_series(0, 199) AS i",
                    (wave,),
                )
            time.sleep(0.5)
            running.pop(0).end()
            running.append(_Running(fast, broker))
            time.sleep(0.5)
        deadline = time.monotonic() + 60
        while remaining(database) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert remaining(database) == 0
    finally:
        for each in running:
            each.end()
    numbers = [job.args[0] for job in list(broker.published)]
    assert sorted(numbers) == sorted(w * 1000 + i for w in range(6) for i in range(200)), (
        f"{len(numbers)} published, {len(set(numbers))} distinct"
    )
    by_key: dict[str | None, list[int]] = {}
    for job in broker.published:
        by_key.setdefault(job.ordering_key, []).append(job.args[0])
    for key, seen in by_key.items():
        assert seen == sorted(seen), f"{key} out of order"


def test_changing_the_count_by_restarting_drains_one_by_one_loses_and_reorders_nothing(
    settings: config.Settings, database: str
) -> None:
    """docs/operations/scaling.md, "Changing the number of lanes": two drains of 8 run; each in
    turn is restarted with 4 while rows are staged. The restarted one stands by until the last
    drain of 8 stops; never do both counts lead at once; every row goes once, each key in order."""
    fast = dataclasses.replace(settings, standby_retry_s=0.2, poll_max_s=0.05)
    broker = testing.MemoryAdapter()
    running = [_Running(fast, broker, lanes=8) for _ in range(2)]
    both: list[int] = []

    def stage_wave(wave: int) -> None:
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO staged_jobs (job_name, job_args, ordering_key) "
                "SELECT 'job', jsonb_build_array(%s * 1000 + i), 'k' || (i %% 13) "
                "FROM generate_series(0, 199) AS i",
                (wave,),
            )

    def watch(seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            counts = {each.relay.settings.lanes for each in running if each.relay.leadership.is_leader}
            if len(counts) > 1:
                both.append(len(counts))
            time.sleep(0.01)

    try:
        stage_wave(0)
        watch(0.5)
        running.pop(0).end()
        running.append(_Running(fast, broker, lanes=4))
        stage_wave(1)
        watch(1.0)
        running.pop(0).end()
        running.append(_Running(fast, broker, lanes=4))
        stage_wave(2)
        watch(1.0)
        deadline = time.monotonic() + 60
        while remaining(database) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert remaining(database) == 0
    finally:
        for each in running:
            each.end()
    assert not both, "two counts led at once"
    numbers = [job.args[0] for job in broker.published]
    assert sorted(numbers) == sorted(w * 1000 + i for w in range(3) for i in range(200))
    by_key: dict[str | None, list[int]] = {}
    for job in broker.published:
        by_key.setdefault(job.ordering_key, []).append(job.args[0])
    for key, seen in by_key.items():
        assert seen == sorted(seen), f"{key} out of order"


# --- findings -------------------------------------------------------------------------------------


def through(database: str, port: int) -> str:
    """The test's DSN, but to PgBouncer on ``port``."""
    parts = urllib.parse.urlsplit(database)
    return parts._replace(netloc=f"{parts.username}@127.0.0.1:{port}").geturl()


def _leader_lock_holders(dsn: str, key: int) -> list[tuple[int, str]]:
    """Every backend holding the table's leader lock (any mode), seen from a direct session."""
    classid, objid = connection.split_key(key)
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, mode FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = %s AND objid = %s AND objsubid = 1 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (classid, objid),
        ).fetchall()
    return [(int(pid), str(mode)) for pid, mode in rows]


POOLED_SHARED_LOCK = pytest.mark.xfail(
    strict=True,
    reason="the pooler probe (Store.lock_held_elsewhere) unlocks the leader lock exclusively; a "
    "member's shared lock stays on the pooled backend and no drain of one lane can lead",
)


@pytest.mark.parametrize("lanes", [1, pytest.param(8, marks=POOLED_SHARED_LOCK)])
def test_a_drain_refused_behind_a_transaction_pool_leaves_no_leader_lock_behind(
    settings: config.Settings, database: str, tmp_path: Path, lanes: int
) -> None:
    """G5 (standbys take over within seconds) behind PgBouncer ``pool_mode=transaction``.

    A drain with lanes that is the pool's only client takes the leader lock *shared*; the probe
    on a second session gets the same backend back, sees the lock, and unlocks it with
    ``pg_advisory_unlock`` (exclusive), which cannot release a shared lock (a WARNING, false).
    The drain refuses to lead (PoolerDetected) and closes its client connection, but the pooled
    server backend keeps the shared lock: a drain of one lane, connected directly, then stands by
    for as long as PgBouncer keeps that backend (server_lifetime, an hour by default). A drain of
    one lane in the same place leaves nothing behind (its lock is exclusive)."""
    with pgbouncer.pgbouncer(tmp_path, pool_mode="transaction", pool_size=4) as port:
        pooled = dataclasses.replace(settings, dsn=through(database, port), lanes=lanes)
        member = relay.Relay(pooled, {"default": testing.MemoryAdapter()})
        try:
            with pytest.raises(errors.PoolerDetected):
                member.leadership.try_acquire()
        finally:
            member.shutdown()
        key = leadership.lock_key(settings.schema, settings.table)
        holders = _leader_lock_holders(database, key)
        single = relay.Relay(settings, {"default": testing.MemoryAdapter()})
        try:
            assert holders == [], f"the leader lock is still held by the pooled backend: {holders}"
            assert single.leadership.try_acquire(), "a drain of one lane cannot lead"
        finally:
            single.shutdown()


def _as_process(each: relay.Relay, pid: int) -> str:
    """Name ``each``'s session as drain process ``pid`` on host "h" would, leading or not: the
    relays of a test share one OS process, which ``drain status`` could not tell apart."""
    leading = each.leadership.pid is not None
    name = identity.compose(__version__, pid, "h", time.time() if leading else None)
    each.store.conn.execute("SELECT set_config('application_name', %s, false)", (name,))
    return f"{pid}@h"


@pytest.mark.xfail(
    strict=True,
    reason="drain status reads one holder of the leader lock (admin.leader: found[0]); members "
    "hold it shared, so the others, leading their lanes, are listed as standbys",
)
def test_drain_status_lists_no_member_that_leads_lanes_as_a_standby(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """`drain status` (console.figures.overview) with two drains sharing 8 lanes, 4 each: one is
    shown as the leader, the other, forwarding half the table, as a standby."""
    relays = [r for r, _ in drains(settings, 2, clock)]
    try:
        rounds(relays, clock, 3)
        assert sorted(len(s) for s in shares(relays)) == [4, 4]
        processes = [_as_process(each, 40_001 + n) for n, each in enumerate(relays)]
        db = store.Store(settings)
        try:
            seen = figures.overview(db)
        finally:
            db.close()
        standbys = {found.process for found in seen["standbys"]}
        assert seen["leader"] is not None
        assert not standbys & set(processes), (
            f"leader {seen['leader']['process']}, standbys {sorted(standbys)}: both lead 4 lanes"
        )
    finally:
        for each in relays:
            each.shutdown()


@pytest.mark.xfail(
    strict=True,
    reason="every member leading a lane sets drain_leader 1; the shipped alert DrainMultipleLeaders "
    "(sum by (job) (drain_leader) > 1) fires, critical, on a healthy set of members",
)
def test_members_sharing_lanes_do_not_trip_the_multiple_leaders_alert(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """Three healthy drains sharing 8 lanes, as docs/operations/scaling.md runs them. The alert
    that says "two drains lead one table: a proxy in the way?" sums drain_leader by job."""
    rules = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "drain-alerts.yml"
    assert "sum by (job) (drain_leader) > 1" in rules.read_text()
    relays = [r for r, _ in drains(settings, 3, clock)]
    try:
        rounds(relays, clock, 4)
        assert sorted(len(s) for s in shares(relays)) == [2, 3, 3]
        gauges = [each.metrics.registry.get_sample_value("drain_leader") or 0.0 for each in relays]
        assert sum(gauges) <= 1, f"drain_leader per member: {gauges}: DrainMultipleLeaders fires"
    finally:
        for each in relays:
            each.shutdown()


@pytest.mark.xfail(
    strict=True,
    reason="Scheduler.wait_s is 0 for a member that does not lead lane 0 (its next pass is "
    "-inf, never set): the idle wait is capped to 0 and the member spins, a select per turn",
)
def test_an_idle_member_without_lane_zero_waits_with_schedules_configured(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """Two idle members and one daily schedule: the one leading lane 0 waits between looks, as a
    single leader does. The other's wait is capped by the schedules' next pass, which it never
    makes: 0 s, every turn — a core and a transaction a turn, as long as the table is idle."""
    daily = config.ScheduleSettings(name="nightly", cron="0 3 * * *", job_name="app.nightly")
    scheduled = dataclasses.replace(settings, schedules=(daily,))
    relays = [r for r, _ in drains(scheduled, 2, clock)]
    try:
        rounds(relays, clock, 3)
        assert sorted(len(s) for s in shares(relays)) == [4, 4]
        (other,) = [each for each in relays if not each.leadership.leads_schedules]
        (zero,) = [each for each in relays if each.leadership.leads_schedules]
        assert min(zero.turn() for _ in range(5)) > 0, "lane 0's leader idles"
        waits = [other.turn() for _ in range(5)]
        assert min(waits) > 0, f"the other member's waits: {waits}"
    finally:
        for each in relays:
            each.shutdown()
