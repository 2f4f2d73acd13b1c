"""Two latency paths of the loop (issue 14), on a real Postgres with in-memory backends.

- A settlement commits without waiting for the WAL flush (synchronous_commit = off, for that
  transaction only); a schedule's pass, which stages jobs, keeps the server's setting.
- A producer's open transaction (the wake lock refused) is looked at again within a millisecond,
  and consecutive refusals back off to the poll's own wait, never beyond it.
"""

from __future__ import annotations

from typing import Any

import psycopg

import drain
from drain import config, testing
from drain.relay import pacing, schedules, settle, wakeup
from drain.store import session as store
from drain.store import writes
from tests.conftest import ManualClock
from tests.support import relays


def _setting(db: store.Store) -> str:
    row = db.conn.execute("SHOW synchronous_commit").fetchone()
    assert row is not None
    return str(row[0])


def test_a_settlement_commits_without_waiting_for_the_flush(
    settings: config.Settings, clock: ManualClock
) -> None:
    relay_ = relays.leading(settings, {"default": testing.MemoryAdapter()}, clock)
    seen: list[str] = []
    write = relay_.settler._write

    def spying_write(batch: store.Batch, decided: settle.Settlement, *, careful: bool) -> writes.Refused:
        seen.append(_setting(relay_.store))  # inside the settlement's transaction
        return write(batch, decided, careful=careful)

    relay_.settler._write = spying_write  # type: ignore[method-assign]
    with psycopg.connect(settings.dsn) as app:  # commits on leaving
        drain.stage(app, "app.tasks.one")
    assert relay_.drain_once().published == 1
    assert seen == ["off"]
    assert _setting(relay_.store) == "on"  # SET LOCAL: the session's own setting is untouched
    relay_.shutdown()


def test_a_schedule_pass_keeps_the_servers_setting(settings: config.Settings, clock: ManualClock) -> None:
    """Its jobs and its last tick commit together and must not be lost: not relaxed."""
    entry = config.ScheduleSettings(name="nightly", cron="* * * * *", job_name="app.tasks.tick")
    relay_ = relays.leading(settings, {"default": testing.MemoryAdapter()}, clock, schedules=(entry,))
    calls: list[bool] = []
    original = relay_.store.batch

    def spying_batch(**kwargs: bool) -> Any:
        calls.append(kwargs.get("relaxed", False))
        return original(**kwargs)

    relay_.store.batch = spying_batch  # type: ignore[method-assign]
    assert isinstance(relay_.scheduler, schedules.Scheduler)
    relay_.scheduler.stage_due()
    assert calls == [False]
    relay_.shutdown()


class _Busy:
    """A wake-up whose lock a producer always holds (arm refused), counting the arms."""

    armed = False
    trusted = True
    next_due_s = None  # nothing due later, as seen after arming

    def __init__(self) -> None:
        self.arms = 0
        self.answer = wakeup.BUSY

    def arm(self) -> str:
        self.arms += 1
        return self.answer

    def disarm(self) -> None:
        pass

    def forget(self) -> None:
        pass


def test_an_open_producer_transaction_is_looked_at_again_within_a_millisecond(
    settings: config.Settings, clock: ManualClock
) -> None:
    relay_ = relays.leading(
        settings, {"default": testing.MemoryAdapter()}, clock, poll_min_s=0.01, poll_max_s=1.0
    )
    busy = _Busy()
    relay_.wakeup = busy  # type: ignore[assignment]
    with psycopg.connect(settings.dsn) as app:  # commits on leaving
        drain.stage(app, "app.tasks.one")
    waits = [relay_.turn()]  # forwards the row (a partial batch), then the lock is refused
    assert busy.arms == 1
    assert 0 < waits[0] <= pacing.BUSY_MIN_S
    waits += [relay_.turn() for _ in range(12)]  # nothing due, still refused: back off
    assert waits[1] > waits[0] / 2
    assert max(waits) <= pacing.LOCKED_MAX_S  # no whole poll: other producers' rows wait on it
    assert waits[-1] > pacing.LOCKED_MAX_S / 2  # grew, not stuck at a millisecond
    busy.answer = wakeup.SLEEP  # the producer committed: armed; the next refusal is fast again
    relay_.turn()
    busy.answer = wakeup.BUSY
    with psycopg.connect(settings.dsn) as app:  # commits on leaving
        drain.stage(app, "app.tasks.two")
    assert relay_.turn() <= pacing.BUSY_MIN_S
    relay_.shutdown()


def test_rows_arriving_together_are_looked_at_again_unarmed(
    settings: config.Settings, clock: ManualClock
) -> None:
    """A step that found a few rows lingers (poll_min_s, at most LINGER_MAX_S) without arming the
    wake-up: what commits meanwhile goes in one batch, and no producer pays for a notification
    (issue 26). A lone row arms as before (test above)."""
    relay_ = relays.leading(
        settings, {"default": testing.MemoryAdapter()}, clock, poll_min_s=5.0, poll_max_s=30.0
    )
    busy = _Busy()
    busy.answer = wakeup.SLEEP
    relay_.wakeup = busy  # type: ignore[assignment]
    with psycopg.connect(settings.dsn) as app:  # commits on leaving
        drain.stage(app, "app.tasks.one")
        drain.stage(app, "app.tasks.two")
    assert relay_.turn() == pacing.LINGER_MAX_S  # not poll_min_s: a long idle poll never delays a trickle
    assert busy.arms == 0
    relay_.turn()  # nothing found: armed
    assert busy.arms == 1
