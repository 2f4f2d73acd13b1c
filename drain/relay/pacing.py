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
                     nothing due ──► the idle wait; trusted, wakeup_poll_max_s at once
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
"""The longest wait between looks while the wake-up cannot be armed (an app's transaction locks a
due row, or a producer's holds the wake lock): what a fresh row may wait then."""
RECONNECT_MAX_S = 10.0
LINGER_MAX_S = 0.01
LINGER_MIN_ROWS = 2
"""After a step that found this many rows, the relay looks again in poll_min_s (at most
LINGER_MAX_S), unarmed: a steady trickle goes in batches of what commits in that time."""


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
        self._idle = backoff.Backoff(settings.poll_min_s, settings.poll_max_s, jitter)
        armed_max_s = max(settings.poll_max_s, settings.wakeup_poll_max_s)
        self._armed_idle = backoff.Backoff(settings.poll_min_s, armed_max_s, jitter)
        locked_max_s = min(LOCKED_MAX_S, settings.poll_max_s)
        self._busy = backoff.Backoff(BUSY_MIN_S, locked_max_s, jitter)  # a producer's open transaction
        self._locked = backoff.Backoff(BUSY_MIN_S, locked_max_s, jitter)  # nothing selected, a row due
        self._reconnects = backoff.Backoff(RECONNECT_MIN_S, RECONNECT_MAX_S, jitter)
        standby_s = settings.standby_retry_s * 1.5  # jittered to 0.75-1.5 x standby_retry_s
        self._standby = backoff.Backoff(standby_s, standby_s, jitter)

    def standby_s(self) -> float:
        return self._standby.delay(1)

    def reconnect_s(self) -> float:
        """The wait after the database failed the turn: growing."""
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
        """The wait after a step, as the module's diagram says.

        - ``due_in()``: when the idle wait must end (a schedule's tick, the earliest future row,
          a held row's next try).
        - ``wakeup_``: the wake-up, when on. Not armed while ``holding()`` (a backend is paused,
          or rows are held out of selection): their rows are due but not selectable, so
          "anything due?" would always say yes.
        """
        if report.selected:
            self._locked.reset()  # rows were there to take: no transaction held them back
        if report.full or report.again or in_flight:
            self._idle.reset()
            return 0.0
        if report.collected and not report.selected:
            # The rows an ordering key held behind the collected batches are free only now: look
            # again at once, not after a poll (a hot key waited LOCKED_MAX_S for each row).
            self._idle.reset()
            return 0.0
        if report.selected >= LINGER_MIN_ROWS:
            # Rows arrive together: take what commits meanwhile in one batch, unarmed. Arming made
            # every few jobs pay for a step and three round trips, and producers for a notification.
            self._idle.reset()
            return min(self.poll_min_s, LINGER_MAX_S)
        if report.selected:
            self._idle.reset()
            wait = self.poll_min_s
        else:
            wait = self._idle.next()
        # Armed and trusted, the sleep is only the net under the notifications: at once its
        # longest, so a steady trickle pays one step a job, not a step for each poll between.
        armed_wait = self._armed_idle.delay(backoff.MAX_DOUBLINGS)
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
        """Arm the wake-up and return the wait it allows."""
        self.failpoints.hit("before_arm")
        armed = wakeup_.arm()
        if armed == wakeup.BUSY:
            # A producer holds the wake lock between its INSERT and its COMMIT, usually a
            # millisecond: look again soon, backing off so a long-open one makes no spin.
            return min(wait, self._busy.next())
        self._busy.reset()
        if armed == wakeup.DUE:
            if not report.selected:
                # Due, yet the step selected nothing: an app's transaction locks the row. Look again
                # soon, backing off, not at once for as long as it stays open.
                return self._locked.next()
            self._idle.reset()
            return 0.0
        due_s = wakeup_.next_due_s  # a row committed since seconds_until_due notified nobody
        if due_s is not None:
            wait, armed_wait = max(min(wait, due_s), 0.0), max(min(armed_wait, due_s), 0.0)
        if wakeup_.trusted:
            return max(wait, armed_wait)
        return wait
