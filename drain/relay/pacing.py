"""How long the relay's loop waits before its next turn (each wait grows by drain.relay.backoff).

::

    after a step:  full batch, select met a change (40001), batches in flight ──► 0 (at once)
                   nothing new, but batches in flight collected (the rows of the keys
                     they held are free now) ──────────────────────────────────► 0 (at once)
                   a partial batch of LINGER_MIN_ROWS or more ──► poll_min_s (at most
                                     LINGER_MAX_S), unarmed: more are committing
                   a single row ──► poll_min_s, armed as below
                   nothing found ──► the idle streak: poll_min_s doubling to poll_max_s, never
                                     past the next schedule tick, the earliest future row, or a
                                     held row's next try
                   then, with the wake-up on, arm it (a producer's commit ends the wait):
                     a producer holds the wake lock ──► BUSY_MIN_S doubling to LOCKED_MAX_S
                     a row is due the step did not get (an app's lock) ──► the same, its streak
                     nothing due ──► the idle wait; trusted, up to wakeup_poll_max_s
    standing by:   standby_retry_s, jittered to 0.75-1.5 x
    database lost: RECONNECT_MIN_S doubling to RECONNECT_MAX_S, until a step succeeds
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from drain.config import settings as config
from drain.relay import backoff, failpoints, reporting, wakeup

RECONNECT_MIN_S = 0.5
BUSY_MIN_S = 0.001  # a producer's transaction is open: its commit is likely a moment away
LOCKED_MAX_S = 0.1
"""The longest the idle leader waits between looks while it cannot arm the wake-up: an app's
transaction locks a due row, or a producer's open transaction holds the wake lock. This is what a
fresh row may wait then (red teams 28 and 29: up to poll_max_s)."""
RECONNECT_MAX_S = 10.0
LINGER_MAX_S = 0.01
LINGER_MIN_ROWS = 2
"""After a step that found rows, the relay looks again in poll_min_s, unarmed, at most this: a
steady trickle is then forwarded in batches of what commits in that time (its jobs wait for it),
and a larger poll_min_s (a drain that relies on the wake-up when idle) never delays a trickle."""


class Pacing:
    """The loop's waits: each kind its own growing streak, reset when it no longer applies."""

    def __init__(
        self,
        settings: config.Settings,
        jitter: Callable[[], float],
        failpoints_: failpoints.Failpoints,
    ) -> None:
        self.poll_min_s = settings.poll_min_s
        self.failpoints = failpoints_
        self._idle = backoff.Streak(backoff.Backoff(settings.poll_min_s, settings.poll_max_s, jitter))
        armed_max_s = max(settings.poll_max_s, settings.wakeup_poll_max_s)
        self._armed_idle = backoff.Backoff(settings.poll_min_s, armed_max_s, jitter)
        self._busy = backoff.Streak(
            backoff.Backoff(BUSY_MIN_S, min(LOCKED_MAX_S, settings.poll_max_s), jitter)
        )
        self._locked = backoff.Streak(
            backoff.Backoff(BUSY_MIN_S, min(LOCKED_MAX_S, settings.poll_max_s), jitter)
        )
        """Steps that selected nothing while a row was due: another transaction locks it."""
        self._reconnects = backoff.Streak(backoff.Backoff(RECONNECT_MIN_S, RECONNECT_MAX_S, jitter))
        standby_s = settings.standby_retry_s * 1.5  # jittered to 0.75-1.5 x standby_retry_s
        self._standby = backoff.Backoff(standby_s, standby_s, jitter)

    def standby_s(self) -> float:
        """The wait of a drain that did not get the lead."""
        return self._standby.delay(1)

    def reconnect_s(self) -> float:
        """The wait after the database failed the turn (its session is closed): growing."""
        return self._reconnects.next()

    def connected(self) -> None:
        """A turn succeeded: the next database failure waits the least again."""
        self._reconnects.reset()

    def after(
        self,
        report: reporting.BatchReport,
        wakeup_: wakeup.Wakeup | None,
        *,
        in_flight: bool,
        due_in: Callable[[], Iterable[float | None]],
        holding: Callable[[], bool],
    ) -> float:
        """The wait after a step. Full batch or batches in flight: at once (the next step
        settles what is in flight if it finds nothing new). Partial: the shortest poll (at most
        LINGER_MAX_S, unarmed, for LINGER_MIN_ROWS rows or more). Idle:
        back off, but wake when the earliest of ``due_in()`` falls due (a schedule's tick, the
        earliest future row as the database's clock says, a held row's next try).

        With the wake-up on (``wakeup_``), an empty step or a single row arms it
        (drain.relay.wakeup): a producer's commit ends the wait, which is then only the safety net,
        so an idle one backs off further, to wakeup_poll_max_s, while no notification was missed.
        Not while ``holding()`` (a backend is paused: its rows are due but not selectable, so
        "anything due?" would always say yes; or rows are held out of selection,
        drain.relay.settling.Unsettled, for the same reason): the leader then polls, and wakes when
        a held row's next try is due."""
        if report.selected:
            self._locked.reset()  # rows were there to take: no transaction held them back
        if report.full or report.again or in_flight:
            self._idle.reset()
            return 0.0
        if report.collected and not report.selected:
            # It settled batches an earlier step left in flight and found nothing new: the rows
            # their ordering key held behind those (key_free) are free only now. Look again at
            # once, not after a poll nor as if an app's lock held them (a hot key in a pipelined
            # loop waited up to LOCKED_MAX_S for each row). Once: the next step found them, or
            # it collects nothing and the loop idles.
            self._idle.reset()
            return 0.0
        if report.selected >= LINGER_MIN_ROWS:
            # Rows are arriving together: look again in poll_min_s, unarmed, and take what
            # commits meanwhile in one batch. Arming here made every few jobs pay for a step of
            # their own and three more round trips (arm, "anything due?", disarm), and their
            # producers for a notification each (issue 26: 3.5 jobs a step at 600/s). A lone row
            # arms as before: at 100 jobs/s the next one is best woken for (p50 5 ms, not 10).
            self._idle.reset()
            return min(self.poll_min_s, LINGER_MAX_S)
        armed_wait = wait = self.poll_min_s
        if report.selected:
            self._idle.reset()
        else:
            wait = self._idle.next()
            armed_wait = self._armed_idle.delay(self._idle.count)
            for until in due_in():
                if until is not None:
                    wait = max(min(wait, until), 0.0)
                    armed_wait = max(min(armed_wait, until), 0.0)
        if wakeup_ is None or wait <= 0 or holding():
            return wait
        return self._arm(wakeup_, report, wait, armed_wait)

    def _arm(
        self, wakeup_: wakeup.Wakeup, report: reporting.BatchReport, wait: float, armed_wait: float
    ) -> float:
        """Arm the wake-up and return the wait it allows: see the module docstring."""
        self.failpoints.hit("before_arm")
        armed = wakeup_.arm()
        if armed is wakeup.Armed.BUSY:
            # A producer holds the wake lock shared between its INSERT and its COMMIT, usually
            # for a millisecond or less: look again soon rather than a whole poll later (under
            # load, that poll was most of the latency). Consecutive refusals back off up to
            # LOCKED_MAX_S, so a long-open producer transaction neither makes the drain spin nor
            # holds other producers' rows for a whole poll (red team 29: 0.4-0.6 s).
            return min(wait, self._busy.next())
        self._busy.reset()
        if armed is wakeup.Armed.DUE:
            if not report.selected:
                # Due, yet the step selected nothing: an app's transaction locks the row
                # (select_due skips locked rows). Look again soon, backing off, rather than at
                # once for as long as that transaction stays open (red team 27: 700 turns/s).
                return self._locked.next()
            self._idle.reset()
            return 0.0
        due_s = wakeup_.next_due_s  # a row committed since seconds_until_due notified nobody
        if due_s is not None:
            wait, armed_wait = max(min(wait, due_s), 0.0), max(min(armed_wait, due_s), 0.0)
        if wakeup_.trusted:
            return max(wait, armed_wait)
        return wait
