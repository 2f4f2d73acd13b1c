"""A settlement that failed with every row of its step in flight (a lost session at the
settlement of a wholly pipelined step) leaves nothing to write again: the next term must not
spin on it (red team 25: 186,670 empty steps in 66 s, nothing forwarded, no watchdog)."""

from __future__ import annotations

import psycopg

import drain
from drain import config, testing
from tests.conftest import ManualClock
from tests.support import relays


def test_a_failed_settlement_with_nothing_kept_ends_and_forwarding_resumes(
    settings: config.Settings, clock: ManualClock
) -> None:
    memory = testing.MemoryAdapter("default")
    the_relay = relays.leading(settings, {"default": memory}, clock)
    try:
        the_relay.settler.held.failed([], {})  # the state a lost session left: failing, nothing kept
        with psycopg.connect(settings.dsn) as app:
            drain.stage(app, "app.tasks.after")
        for _ in range(5):
            clock.advance(the_relay.turn())
            if memory.published:
                break
        assert not the_relay.settler.held.failing
        assert [job.job_name for job in memory.published] == ["app.tasks.after"]
    finally:
        the_relay.shutdown()
