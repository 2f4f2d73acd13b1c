"""A due row an app's transaction locks is skipped by the batch (FOR UPDATE SKIP LOCKED) but
counted as due by the wake-up's last look: the idle leader turned at once, again and again, for as
long as that transaction stayed open (red team 27: 700 turns a second). It backs off instead."""

from __future__ import annotations

import dataclasses

import psycopg

import drain
from drain import config, relay, testing
from tests.conftest import ManualClock
from tests.support import relays


def test_a_due_row_locked_by_an_app_makes_the_idle_leader_back_off_not_spin(
    settings: config.Settings, clock: ManualClock
) -> None:
    settings = dataclasses.replace(settings, poll_max_s=5.0)
    memory = testing.MemoryAdapter("default")
    the_relay = relays.leading(settings, {"default": memory}, clock, wakeup=config.WAKEUP_NOTIFY)
    with psycopg.connect(settings.dsn) as app:
        drain.stage(app, "app.tasks.locked")
    try:
        with psycopg.connect(settings.dsn) as holder:
            holder.execute("SELECT id FROM staged_jobs FOR UPDATE")  # open until the block ends
            waits = []
            for _ in range(12):
                wait = the_relay.turn()
                waits.append(wait)
                clock.advance(wait)
            assert not memory.published
            assert waits[-1] >= 0.05, waits  # backing off (at once, before: 0.0 every turn)
            assert waits == sorted(waits), waits
            # capped: a fresh row staged meanwhile waits no longer (red team 28: up to poll_max_s)
            assert max(waits) <= relay.LOCKED_MAX_S, waits
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
    settings = dataclasses.replace(settings, poll_max_s=5.0)
    memory = testing.MemoryAdapter("default")
    the_relay = relays.leading(settings, {"default": memory}, clock, wakeup=config.WAKEUP_NOTIFY)
    try:
        with psycopg.connect(settings.dsn) as producer:
            drain.stage(producer, "app.tasks.open")  # not committed until the block ends
            waits = []
            for _ in range(12):
                wait = the_relay.turn()
                waits.append(wait)
                clock.advance(wait)
            assert not memory.published
            assert 0 < max(waits) <= relay.LOCKED_MAX_S, waits
    finally:
        the_relay.shutdown()
