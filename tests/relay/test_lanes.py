"""Lanes (drain.relay.lanes): several drains forward one table, each leading a fair share of its
lanes; every row goes once per leader of its lane, per-key order holds across hand-overs, a drain
of another count stands by, and a drain of one lane excludes them all (and they it)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from drain import config, errors, testing
from drain.relay import lanes as lanes_mod
from drain.relay import leadership
from drain.relay import loop as relay
from drain.store import session as store
from tests.conftest import ManualClock

LANES = 8


def stage(dsn: str, rows: int, keys: int) -> None:
    """``rows`` rows in id order; row i carries key ``k{i % keys}`` (keys 0: none) and its
    number in job_args."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (job_name, job_args, ordering_key) "
            "SELECT 'job', jsonb_build_array(i), CASE WHEN %s > 0 THEN 'k' || (i %% %s) END "
            "FROM generate_series(0, %s - 1) AS i",
            (keys, max(keys, 1), rows),
        )


def remaining(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    assert row is not None
    return int(row[0])


def drains(
    settings: config.Settings,
    count: int,
    clock: ManualClock,
    lanes: int = LANES,
    adapter: testing.MemoryAdapter | None = None,
) -> Iterator[tuple[relay.Relay, testing.MemoryAdapter]]:
    """``count`` relays with ``lanes``, each its own memory adapter unless ``adapter`` is shared."""
    for _ in range(count):
        each = adapter or testing.MemoryAdapter()
        tuned = dataclasses.replace(
            settings,
            lanes=lanes,
            batch_size=50,
            backends={"default": config.BackendSettings("default", "memory", 3, {})},
        )
        yield relay.Relay(tuned, {"default": each}, clock=clock, jitter=lambda: 0.5), each


def turns(relays: list[relay.Relay], clock: ManualClock, rounds: int, dsn: str) -> None:
    """Turn every relay ``rounds`` times (or until the table is empty), the clock past each
    balance interval every round."""
    for _ in range(rounds):
        for each in relays:
            each.turn()
        clock.advance(1.0)
        if remaining(dsn) == 0:
            return


def rounds(relays: list[relay.Relay], clock: ManualClock, count: int) -> None:
    """Turn every relay ``count`` times, the clock past each balance interval every round."""
    for _ in range(count):
        for each in relays:
            each.turn()
        clock.advance(1.0)


def indexed(the_relay: relay.Relay) -> float | None:
    return the_relay.metrics.registry.get_sample_value("drain_lanes_indexed")


def shares(relays: list[relay.Relay]) -> list[set[int]]:
    return [set(getattr(each.leadership, "led", set())) for each in relays]


# --- the plan ---------------------------------------------------------------------------------


def test_a_lone_member_takes_every_free_lane() -> None:
    step = lanes_mod.plan(8, 0, {}, set())
    assert (step.take, step.release, len(step.free)) == (8, 0, 8)


def test_a_member_above_its_share_hands_the_excess_over() -> None:
    assert lanes_mod.plan(8, 8, {1: 0, 2: 0, 3: 0}, set(range(8))).release == 6


def test_a_member_at_the_ceiling_hands_one_over_while_another_is_below_the_floor() -> None:
    """7 lanes over 3: (3, 3, 1) would be stable if the ceiling were enough."""
    assert lanes_mod.plan(7, 3, {1: 3, 2: 1}, set(range(7))).release == 1


@hsettings(max_examples=200, deadline=None)
@given(
    lanes=st.integers(1, 40),
    members=st.integers(1, 9),
    seed=st.lists(st.integers(0, 8), min_size=40, max_size=40),
)
def test_balances_converge_to_a_fair_share_and_never_share_a_lane(
    lanes: int, members: int, seed: list[int]
) -> None:
    """Members balancing in turn, from any start, end with ⌈N/M⌉ or ⌊N/M⌋ lanes each."""
    owner: dict[int, int] = {}
    for lane, who in zip(range(lanes), seed, strict=False):
        if who < members:
            owner[lane] = who
    for _ in range(6 * (lanes + members)):
        for me in range(members):
            counts = {m: sum(1 for o in owner.values() if o == m) for m in range(members)}
            others = {m: c for m, c in counts.items() if m != me}
            step = lanes_mod.plan(lanes, counts[me], others, set(owner))
            if step.release:
                for lane in sorted((lane for lane, o in owner.items() if o == me), reverse=True)[
                    : step.release
                ]:
                    del owner[lane]
            for lane in step.free[: step.take]:
                assert lane not in owner
                owner[lane] = me
    counts = sorted(sum(1 for o in owner.values() if o == m) for m in range(members))
    assert len(owner) == lanes, "every lane is led"
    assert counts[0] >= lanes // members and counts[-1] <= -(-lanes // members), counts


# --- drains on a real table -------------------------------------------------------------------


def test_three_drains_split_eight_lanes_and_forward_every_row_once_in_key_order(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """The first drain leads all 8 lanes and starts forwarding alone; the others join mid-backlog
    and lanes are handed over under way. One broker (a shared memory adapter) sees the order."""
    stage(database, 600, keys=40)
    broker = testing.MemoryAdapter()
    relays = [r for r, _ in drains(settings, 3, clock, adapter=broker)]
    try:
        relays[0].turn()
        turns(relays, clock, 60, database)
        led = shares(relays)
        assert sorted(len(s) for s in led) == [2, 3, 3]
        assert set().union(*led) == set(range(LANES))
        assert sum(len(s) for s in led) == LANES, "no lane led twice"
        assert remaining(database) == 0
        numbers = sorted(job.args[0] for job in broker.published)
        assert numbers == list(range(600)), "every row once"
        by_key: dict[str | None, list[int]] = {}
        for job in broker.published:
            by_key.setdefault(job.ordering_key, []).append(job.args[0])
        for key, seen in by_key.items():
            assert seen == sorted(seen), f"{key} out of order"
    finally:
        for each in relays:
            each.shutdown()


def test_once_migrate_builds_the_lanes_index_members_read_their_lanes_through_it_in_key_order(
    settings: config.Settings, database: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the lanes index each member says so once and walks the due index; after `drain
    migrate` with lanes = 8 builds it, each member (2 lanes of 8) finds it within
    INDEX_LOOK_EVERY_S and reads its lanes through it: every row once, per-key order kept."""
    broker = testing.MemoryAdapter()
    relays = [r for r, _ in drains(settings, 4, clock, adapter=broker)]
    try:
        with caplog.at_level("WARNING", logger="drain.relay.lanes"):
            rounds(relays, clock, 3)
        said = [r for r in caplog.records if getattr(r, "event", None) == "lanes_index_missing"]
        assert len(said) == len(relays), "each member says it once"
        assert all(each.store.reader.indexed_lanes() is None for each in relays)
        assert [indexed(each) for each in relays] == [0] * 4
        store.Store(dataclasses.replace(settings, lanes=LANES)).migrate()
        rounds(relays, clock, int(lanes_mod.INDEX_LOOK_EVERY_S) + 1)
        assert [each.store.reader.indexed_lanes() for each in relays] == [LANES] * 4
        assert [indexed(each) for each in relays] == [1] * 4
        stage(database, 800, keys=60)
        turns(relays, clock, 60, database)
        assert remaining(database) == 0
        assert sorted(job.args[0] for job in broker.published) == list(range(800)), "every row once"
        by_key: dict[str | None, list[int]] = {}
        for job in broker.published:
            by_key.setdefault(job.ordering_key, []).append(job.args[0])
        for key, seen in by_key.items():
            assert seen == sorted(seen), f"{key} out of order"
        said = [r for r in caplog.records if getattr(r, "event", None) == "lanes_index_missing"]
        assert len(said) == len(relays), "said once"
    finally:
        for each in relays:
            each.shutdown()


def test_once_balanced_each_key_is_forwarded_by_its_lanes_leader_only(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    pairs = list(drains(settings, 3, clock))
    relays = [r for r, _ in pairs]
    try:
        rounds(relays, clock, 3)
        stage(database, 400, keys=40)
        turns(relays, clock, 40, database)
        assert remaining(database) == 0
        assert all(adapter.published for _, adapter in pairs), "each drain forwarded its lanes' rows"
        keys_by_drain = [{job.ordering_key for job in adapter.published} for _, adapter in pairs]
        for a, b in itertools.combinations(keys_by_drain, 2):
            assert not a & b, "a key is forwarded by one drain (its lane's)"
    finally:
        for each in relays:
            each.shutdown()


def test_a_drain_that_joins_takes_lanes_and_one_that_leaves_hands_them_on(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    pairs = list(drains(settings, 3, clock))
    first, second, third = (r for r, _ in pairs)
    try:
        first.turn()
        assert shares([first]) == [set(range(LANES))]
        second.turn()  # a member with no lane yet: the first hands 4 over at its next balance
        clock.advance(1.0)
        first.turn()
        second.turn()
        assert sorted(len(s) for s in shares([first, second])) == [4, 4]
        third.turn()
        for _ in range(3):
            clock.advance(1.0)
            for each in (first, second, third):
                each.turn()
        assert sorted(len(s) for s in shares([first, second, third])) == [2, 3, 3]
        second.shutdown()
        for _ in range(3):
            clock.advance(1.0)
            for each in (first, third):
                each.turn()
        assert sorted(len(s) for s in shares([first, third])) == [4, 4]
        stage(database, 200, keys=0)
        turns([first, third], clock, 20, database)
        assert remaining(database) == 0
    finally:
        for each in (first, second, third):
            each.shutdown()


def test_a_batch_is_fenced_by_every_lane_it_leads(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """A lane lock lost (here: unlocked behind the drain's back) fails the next batch: nothing is
    selected, nothing published."""
    stage(database, 20, keys=0)
    ((the_relay, adapter),) = drains(settings, 1, clock)
    try:
        assert the_relay.leadership.try_acquire()
        assert isinstance(the_relay.leadership, lanes_mod.Lanes)
        lane = min(the_relay.leadership.led)
        the_relay.store.unlock_lane(the_relay.leadership.space, lane)
        with pytest.raises(errors.LeadershipLost):
            the_relay.drain_once()
        assert adapter.published == []
    finally:
        the_relay.shutdown()


def test_a_drain_of_another_count_stands_by_and_says_why(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    ((eight, _),) = drains(settings, 1, clock, lanes=8)
    ((four, _),) = drains(settings, 1, clock, lanes=4)
    try:
        eight.turn()
        assert eight.leadership.is_leader
        four.turn()
        assert not four.leadership.is_leader
        assert four.leadership.blocker is not None
        assert four.leadership.blocker.reason == leadership.LANES
        assert "lanes = 8" in four.leadership.blocker.detail
        eight.shutdown()
        clock.advance(1.0)
        four.turn()
        assert shares([four]) == [set(range(4))]
    finally:
        eight.shutdown()
        four.shutdown()


def test_one_lane_and_lanes_exclude_each_other(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """A drain of one lane holds the leader lock exclusively; members hold it shared."""
    single = relay.Relay(
        dataclasses.replace(
            settings, backends={"default": config.BackendSettings("default", "memory", 3, {})}
        ),
        {"default": testing.MemoryAdapter()},
        clock=clock,
    )
    ((laned, _),) = drains(settings, 1, clock)
    try:
        assert single.leadership.try_acquire()
        assert not laned.leadership.try_acquire()
        single.shutdown()
        assert laned.leadership.try_acquire()
        fresh = relay.Relay(single.settings, {"default": testing.MemoryAdapter()}, clock=clock)
        try:
            assert not fresh.leadership.try_acquire()
        finally:
            fresh.shutdown()
    finally:
        single.shutdown()
        laned.shutdown()


def test_the_schedules_are_staged_by_lane_zeros_leader_only(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    pairs = list(drains(settings, 2, clock))
    relays = [r for r, _ in pairs]
    try:
        rounds(relays, clock, 3)
        stagers = [r for r in relays if r.leadership.leads_schedules]
        assert len(stagers) == 1
        assert 0 in getattr(stagers[0].leadership, "led", set())
    finally:
        for each in relays:
            each.shutdown()


def test_an_idle_member_wakes_for_its_next_balance(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """Armed and trusted, an idle leader sleeps wakeup_poll_max_s; a member's sleep ends at its
    next balance, so the lanes of a drain that died are taken within standby_retry_s."""
    long_sleep = dataclasses.replace(settings, wakeup_poll_max_s=60.0, poll_max_s=60.0, standby_retry_s=0.5)
    pairs = list(drains(long_sleep, 2, clock))
    first, second = (r for r, _ in pairs)
    try:
        rounds([first, second], clock, 3)
        assert sorted(len(s) for s in shares([first, second])) == [4, 4]
        second.store.close()  # dies: its session, and its lanes with it
        waits = [first.turn() for _ in range(3)]
        assert max(waits) <= 0.5, waits
        clock.advance(0.5)
        first.turn()
        assert shares([first]) == [set(range(LANES))]
    finally:
        first.shutdown()
        second.shutdown()


def test_free_lanes_are_led_while_a_member_below_its_share_is_frozen(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """The lanes fault test (tests/faults/test_lanes_faults.py) saw it: a drain SIGKILLed while
    another was frozen left one of its lanes unled for 8.5 s, until the killed drain's successor
    joined; without a successor, until the frozen drain's session ended (its fence, 11 s there).

    Here: three members (3, 3, 2), the one with 2 stops turning and the first leaves. The last
    live member leads 3 and sees 3 free lanes beside a member of 2: with M = 2 its share is 4, the
    frozen one is below 4, so it took 1 and left 2 free for a member that never takes them. A
    member whose session has been quiet for lanes.SILENT_BALANCES intervals is no longer counted."""
    relays = [r for r, _ in drains(settings, 3, clock)]
    try:
        rounds(relays, clock, 6)
        led = shares(relays)
        assert sorted(len(s) for s in led) == [2, 3, 3]
        frozen = relays[[len(s) for s in led].index(2)]
        leaving, live = (r for r in relays if r is not frozen)
        leaving.shutdown()
        deadline = time.monotonic() + 10.0  # the frozen one's session is quiet on the server's clock
        while time.monotonic() < deadline and len(shares([live])[0] | shares([frozen])[0]) < LANES:
            rounds([live], clock, 1)
            time.sleep(0.1)
        held = shares([live, frozen])
        assert held[0] | held[1] == set(range(LANES)), f"lanes unled: {set(range(LANES)) - held[0] - held[1]}"
        frozen.turn()  # it resumes: counted again, it is owed its share back
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and len(shares([frozen])[0]) < 4:
            rounds([live, frozen], clock, 1)
        assert sorted(len(s) for s in shares([live, frozen])) == [4, 4]
    finally:
        for each in relays:
            each.shutdown()
