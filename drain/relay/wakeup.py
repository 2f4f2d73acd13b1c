"""The idle leader's wake-up: a producer's commit wakes it within milliseconds, and producers pay
for the notification only while the drain sleeps.

::

    step found nothing ──► arm: take the wake lock (try) ──refused──► "busy": poll
                                   │ taken: LISTEN (once per session), then "anything due?"
                                   ├── yes ──► "due": disarm, go round at once
                                   └── no ───► "sleep" on the session's notifications, at most
                                                until the earliest future row falls due
                                                ├── a commit notified ──► disarm, step
                                                └── the poll's timeout ─► disarm, step (the net)

The lock
--------
- The trigger ``drain_wake`` (functions.sql) tries the wake lock *shared* once per INSERT
  statement, held until the producer's transaction ends.
- Taken: the drain is awake, and nothing more is done. Refused: the drain sleeps, so the
  trigger calls pg_notify, whose global lock at commit producers pay only then.
- The drain cannot arm while a producer that did not notify is open, and its "anything due?"
  runs after the lock is taken: it sees every commit that did not notify.
- That statement also says when the earliest future row falls due (``next_due_s``), which caps
  the sleep: no commit announces a ``run_at`` passing.
- The lock and the LISTEN live on the leader's session. If it dies, producers stop notifying,
  and the leader's next statement fails: it steps down.
- With lanes (drain.relay.lanes) every idle member sleeps: the triggers probe several wake locks,
  the table's *wake slots* (``drain migrate`` gives a table as many as its lanes, up to
  store.migrations.MAX_WAKE_SLOTS), each member takes the first one free, and all listen on the
  one channel. A commit wakes every sleeping member, its rows' leaders among them; the others
  find nothing of theirs and sleep again. A member that finds every slot taken polls.

The net
-------
The poll stays (``poll_max_s``). A timed-out sleep that finds a row staged for now means a
notification was missed (the trigger is disabled, or a producer runs with
``session_replication_role = replica``): logged and counted (``drain_wakeup_missed_total``).
``drain check`` and the leader's first LISTEN report a missing trigger (:func:`trigger_warning`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psycopg

from drain import errors
from drain.config import settings as config
from drain.observability import metrics
from drain.store import migrations
from drain.store import session as store

log = logging.getLogger(__name__)

STOP_CHECK_S = 0.2  # a sleeping leader notices the stop event within this
NOTIFY_GRACE_S = 0.05  # a row can be visible a moment before its notification arrives
MISSED_LOG_EVERY_S = 300.0  # one warning per this while notifications keep being missed
DISTRUST_S = 600.0  # after a miss, the short poll (poll_max_s) is the net for this long
RELEARN_SLOTS_S = 5.0  # refused every slot: the trigger's slot count is read again, at most this often


# What arming found.
SLEEP = "sleep"  # armed, nothing due: sleep until notified or the poll's timeout
DUE = "due"  # a row is due already: go round at once (not armed)
BUSY = "busy"  # a producer's transaction is open: poll (not armed)


def trigger_warning(db: store.Store, trigger: tuple[bool, int] | None = None) -> str | None:
    """What to do when ``wakeup = "notify"`` but the ``drain_wake`` trigger is missing or
    disabled, or has fewer wake slots than the lanes call for, in one line; None when all is well
    or the wake-up is off. ``trigger``: what Store.wake_trigger found, if already asked."""
    if db.settings.wakeup != config.WAKEUP_NOTIFY:
        return None
    enabled, slots = db.wake_trigger() if trigger is None else trigger
    wanted = migrations.wake_slots(db.settings.lanes)
    if enabled and slots < wanted:
        return (
            f"the wake-up trigger drain_wake on {db.names.qualified} has {slots} wake slot(s) and "
            f"lanes = {db.settings.lanes} calls for {wanted}: idle members beyond {slots} look for "
            "jobs every 0.1 s instead of sleeping until a commit; run `drain migrate` with this config"
        )
    if enabled:
        return None
    return (
        f"the wake-up trigger drain_wake on {db.names.qualified} is missing or disabled, so staged "
        "jobs wait for the poll (poll_max_s): run `drain migrate` (missing) or ALTER TABLE ... "
        'ENABLE TRIGGER drain_wake (disabled), or set wakeup = "poll"'
    )


class Wakeup:
    """Arms, sleeps and disarms on the Store's session. Use from the relay's thread."""

    def __init__(
        self,
        db: store.Store,
        *,
        metrics_: metrics.Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = db
        self._metrics = metrics_
        self._clock = clock
        self._trigger_reported = False  # the missing trigger was logged; again only once it is back
        self._listening: object | None = None  # the session LISTENing, see Store.listen
        self._slots = 1  # the trigger's wake slots, learnt on each new session before it arms
        self._slots_session: object | None = None  # the session they were learnt on
        self._slots_at = float("-inf")  # when they were learnt
        self.armed = False
        self._timed_out = False
        self._missed_logged_at = float("-inf")
        self._missed_at = float("-inf")
        self.next_due_s: float | None = None  # set by arm(): when the earliest future row falls due
        self.notified = 0
        self.missed = 0

    @property
    def trusted(self) -> bool:
        """No notification was missed lately: the safety-net poll may back off further."""
        return self._clock() - self._missed_at >= DISTRUST_S

    def arm(self) -> str:
        """Take the wake lock and check that nothing is due (the module's diagram). On SLEEP,
        ``next_due_s`` caps the sleep: seconds until the earliest future row falls due."""
        self.next_due_s = None
        session = self._store.listening_on()
        if session is None or session is not self._slots_session:  # every slot from the first arm
            self._slots, self._slots_session = self._store.wake_trigger()[1], self._store.listening_on()
            self._slots_at = self._clock()
        taken, channel = self._store.wake_arm(self._slots)
        if not taken:
            if self._clock() - self._slots_at >= RELEARN_SLOTS_S:
                self._slots_session = None  # every slot taken: a migration may have added some since
            return BUSY
        self._set_armed(True)
        if self._listening is None or self._listening is not self._store.listening_on():
            self._listening = self._store.listen(channel)
            self._report_trigger()
        self._store.wait_notified(0.0)  # notifications from before the check: it covers them
        due = self._store.anything_due()
        if due.now:
            self.disarm()
            return DUE
        self.next_due_s = due.next_due_s
        return SLEEP

    def _report_trigger(self) -> None:
        """On each new listening session: learn the trigger's wake slots; log a missing or
        disabled trigger (or too few slots) once, until it is back."""
        trigger = self._store.wake_trigger()
        self._slots = trigger[1]
        warning = trigger_warning(self._store, trigger)
        if warning is not None and not self._trigger_reported:
            log.warning("%s", warning)
        self._trigger_reported = warning is not None

    def sleep(self, timeout_s: float, stop: threading.Event) -> bool:
        """Sleep until a notification, ``timeout_s`` or ``stop``; True if notified. A database
        error ends it quietly: disarm raises it, where the relay steps down."""
        deadline = self._clock() + timeout_s
        try:
            while not stop.is_set():
                remaining = deadline - self._clock()
                if remaining <= 0:
                    break
                if self._store.wait_notified(min(remaining, STOP_CHECK_S)):
                    self.notified += 1
                    return True
        except psycopg.Error as exc:
            reason = errors.first_line(exc)
            log.debug("the sleeping session failed: %s", reason, extra={"reason": reason})
            return False
        self._timed_out = not stop.is_set()
        return False

    def disarm(self) -> None:
        """Release the wake lock; after a timed-out sleep, check whether a notification was
        missed. LeadershipLost when the session died during the sleep: the Store would quietly
        open a new one, which holds neither this lock nor the leader's."""
        if not self.armed:
            return
        if self._listening is not self._store.listening_on():
            self.forget()
            raise errors.LeadershipLost("the leader's database session was lost while it slept")
        timed_out, self._timed_out = self._timed_out, False
        staged_now = timed_out and self._store.anything_due().staged_now
        if staged_now and not self._store.wait_notified(NOTIFY_GRACE_S):
            self._missed()  # staged for now while we slept, and no notification came
        self._set_armed(False)
        self._store.wake_disarm()

    def forget(self) -> None:
        """The session was lost: the server released the lock and the LISTEN with it."""
        self._set_armed(False)
        self._timed_out = False
        self._listening = None

    def _set_armed(self, armed: bool) -> None:
        self.armed = armed
        if self._metrics is not None:
            self._metrics.set_wakeup_armed(armed)

    def _missed(self) -> None:
        self._slots_session = None  # read the trigger's slots again: its triggers may have been put back
        self.missed += 1
        if self._metrics is not None:
            self._metrics.count_wakeup_missed()
        now = self._clock()
        self._missed_at = now
        if now - self._missed_logged_at < MISSED_LOG_EVERY_S:
            return
        self._missed_logged_at = now
        enabled = self._store.wake_trigger_enabled()
        log.warning(
            "a job became due while the drain slept and no notification woke it (%d so far): %s; "
            "jobs wait for the poll (poll_max_s) until this is fixed",
            self.missed,
            "the wake-up trigger drain_wake is enabled, so a producer may run with "
            "session_replication_role = replica"
            if enabled
            else "the wake-up trigger drain_wake is missing or disabled (run `drain migrate`)",
            extra={
                "event": "wakeup_missed",
                "missed": self.missed,
                "trigger_enabled": enabled,
                "table": self._store.names.qualified,
            },
        )
