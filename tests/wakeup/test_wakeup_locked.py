"""A due row an app's transaction locks is skipped by the batch (FOR UPDATE SKIP LOCKED) but
counted as due by the wake-up's last look: the idle leader turned at once, again and again, for as
long as that transaction stayed open (red team 27: 700 turns a second). It backs off instead."""

from __future__ import annotations

import dataclasses

import psycopg

import drain
from drain import config, testing
from drain.relay import loop as relay
from drain.relay import pacing
from tests.conftest import ManualClock
from tests.support import relays


def idle_leader(settings: config.Settings, memory: testing.MemoryAdapter, clock: ManualClock) -> relay.Relay:
    """A leader with the wake-up on and a long poll (5 s): what bounds its waits is the point."""
    return relays.leading(
        dataclasses.replace(settings, poll_max_s=5.0), {"default": memory}, clock, wakeup=config.WAKEUP_NOTIFY
    )


def turns(the_relay: relay.Relay, clock: ManualClock, count: int) -> list[float]:
    """``count`` turns of the loop, the clock moved by each wait; the waits."""
    waits = []
    for _ in range(count):
        waits.append(the_relay.turn())
        clock.advance(waits[-1])
    return waits


def test_a_due_row_locked_by_an_app_makes_the_idle_leader_back_off_not_spin(
    settings: config.Settings, clock: ManualClock
) -> None:
    memory = testing.MemoryAdapter("default")
    the_relay = idle_leader(settings, memory, clock)
    with psycopg.connect(settings.dsn) as app:
        drain.stage(app, "app.tasks.locked")
    try:
        with psycopg.connect(settings.dsn) as holder:
            holder.execute("SELECT id FROM staged_jobs FOR UPDATE")  # open until the block ends
            waits = turns(the_relay, clock, 12)
            assert not memory.published
            assert waits[-1] >= 0.05, waits  # backing off (at once, before: 0.0 every turn)
            assert waits == sorted(waits), waits
            # capped: a fresh row staged meanwhile waits no longer (red team 28: up to poll_max_s)
            assert max(waits) <= pacing.LOCKED_MAX_S, waits
        for _ in range(5):  # the lock is gone: the row goes
            clock.advance(the_relay.turn())
            if memory.published:
                break
        assert [job.job_name for job in memory.published] == ["app.tasks.locked"]
    finally:
        the_relay.shutdown()


def test_a_long_open_producer_transaction_makes_the_idle_leader_look_again_soon(
    settings: config.Settings, clock: ManualClock
) -> None:
    """A producer that staged a row and keeps its transaction open holds the wake lock shared, so
    the leader cannot arm: it backed off to poll_max_s, and the other producers' rows waited with
    it (red team 29: 0.4-0.6 s). It looks again at most every LOCKED_MAX_S."""
    memory = testing.MemoryAdapter("default")
    the_relay = idle_leader(settings, memory, clock)
    try:
        with psycopg.connect(settings.dsn) as producer:
            drain.stage(producer, "app.tasks.open")  # not committed until the block ends
            waits = turns(the_relay, clock, 12)
            assert not memory.published
            assert 0 < max(waits) <= pacing.LOCKED_MAX_S, waits
    finally:
        the_relay.shutdown()
