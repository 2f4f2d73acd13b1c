"""The database clock is the clock (issue 10 item 10): a drain whose own wall clock is two hours
off neither spins nor oversleeps waiting for a deferred job, forwards it on time, and reports a
sane commit-to-publish delay.

The skew is injected in-process: ``time.time`` and ``datetime.datetime.now`` return the real
time plus (or minus) two hours, while the monotonic clock (what waits use) stays true, as it does
on a machine whose wall clock is wrong.
"""

from __future__ import annotations

import dataclasses
import datetime
import time

import psycopg
import pytest

import drain
from drain import config, testing
from drain.relay import loop as relay
from tests.support.waiting import wait_until

SKEW_S = 2 * 3600.0
DELAY_S = 1.5
BOUND_S = 1.0  # a deferred job is forwarded within this of its run_at while the drain idles


class _Skewed(datetime.datetime):
    skew = datetime.timedelta(0)

    @classmethod
    def now(cls, tz: datetime.tzinfo | None = None) -> _Skewed:  # type: ignore[override]
        return super().now(tz) + cls.skew


@pytest.mark.parametrize("sign", [1, -1], ids=["ahead", "behind"])
def test_a_skewed_local_clock_changes_nothing(
    settings: config.Settings, database: str, monkeypatch: pytest.MonkeyPatch, sign: int
) -> None:
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + sign * SKEW_S)
    monkeypatch.setattr(_Skewed, "skew", datetime.timedelta(seconds=sign * SKEW_S))
    monkeypatch.setattr(datetime, "datetime", _Skewed)

    memory = testing.MemoryAdapter("default")
    settings = dataclasses.replace(
        settings, poll_max_s=5.0, backends={"default": config.BackendSettings("default", "memory", 3, {})}
    )
    the_relay = relay.Relay(settings, {"default": memory})
    try:
        with psycopg.connect(database) as conn:
            drain.stage(conn, "app.later", delay=DELAY_S)
            run_at = conn.execute("SELECT run_at FROM staged_jobs").fetchone()
        turns = 0
        forwarded_at = None

        def forwarded() -> bool:
            nonlocal turns, forwarded_at
            wait = the_relay.turn()
            turns += 1
            if memory.published:  # the time it was forwarded, not after the wait that follows
                with psycopg.connect(database) as conn:
                    forwarded_at = conn.execute("SELECT clock_timestamp()").fetchone()
                return True
            time.sleep(wait)  # as long as the loop says
            return False

        wait_until("the deferred job to be forwarded", forwarded, 30, interval_s=0)
    finally:
        the_relay.shutdown()
    assert run_at is not None and forwarded_at is not None
    late_s = (forwarded_at[0] - run_at[0]).total_seconds()
    assert 0 <= late_s <= BOUND_S + 0.5, late_s  # not before run_at, and not overslept
    assert turns < 40, f"{turns} turns of the loop for one deferred job: it spun"
    count = the_relay.metrics.registry.get_sample_value(
        "drain_commit_to_publish_seconds_count", {"backend": "default"}
    )
    total = the_relay.metrics.registry.get_sample_value(
        "drain_commit_to_publish_seconds_sum", {"backend": "default"}
    )
    assert count == 1 and total is not None
    assert DELAY_S <= total < DELAY_S + 5, total  # from staging to the broker, on the database's clock
