"""Why this drain stands by or cannot settle, said once per reason, and how long it has lasted.

::

    (none) ──a blocker (standing by, a settlement failing)──► said, exported (drain_cannot_settle)
      ▲                                                         │ bounded reason: timed
      │ a step commits, or leadership lost                      ▼
      └──────────────────────────────────────────── settle_timeout_s lasted: CannotSettle (exit 6)

A standby server (waiting for a failover) and an older schema (waiting for ``drain migrate``)
have no bound (drain.relay.settling.Blocker.unbounded). While the clock runs, no wait of the
loop and no lock wait of a settlement lasts past the moment it runs out: the process ends on
time, not a backoff later.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from drain import errors
from drain.config import settings as config
from drain.observability import metrics
from drain.relay import settling

log = logging.getLogger(__name__)

ANOTHER_LEADS = "another_leader"
"""What was said when another drain leads: no reason to export."""


class Blockage:
    """The reason last said (``said``) and since when this drain cannot settle (``since``)."""

    def __init__(
        self, settings: config.Settings, metrics_: metrics.Metrics, clock: Callable[[], float], table: str
    ) -> None:
        self.settle_timeout_s = settings.settle_timeout_s
        self.metrics = metrics_
        self.said: str | None = None
        self.since: float | None = None
        self._clock = clock
        self._table = table

    def cap(self, wait: float) -> float:
        """``wait``, but while this drain cannot settle never past the moment settle_timeout_s
        runs out: the next turn tries once more and ends the process on time."""
        if self.since is None:
            return wait
        return max(min(wait, self.since + self.settle_timeout_s - self._clock()), 0.0)

    def lock_wait_ms(self, most_ms: int) -> int:
        """A settlement's longest lock wait: ``most_ms``, and while this drain cannot settle no
        longer than the time settle_timeout_s leaves (at least 1 ms), so a write that waits for
        a lock on the table never carries the exit past it."""
        if self.since is None:
            return most_ms
        left_s = self.since + self.settle_timeout_s - self._clock()
        return max(min(most_ms, int(left_s * 1000)), 1)

    def out_of_time(self) -> bool:
        """Whether this drain has been unable to settle for settle_timeout_s."""
        since = self.since
        return since is not None and self._clock() - since >= self.settle_timeout_s

    def block(self, blocker: settling.Blocker) -> None:
        """Export the reason, and end the process (CannotSettle) once it lasted settle_timeout_s;
        a standby server (waiting for a failover) and an older schema (waiting for `drain
        migrate`) have no bound."""
        if self.said != blocker.reason:
            self.said = blocker.reason
            self.metrics.set_cannot_settle(blocker.reason)
        if blocker.unbounded:
            self.since = None
            return
        now = self._clock()
        if self.since is None:
            self.since = now
        elif now - self.since >= self.settle_timeout_s:
            raise errors.CannotSettle(
                f"cannot settle for {now - self.since:.0f}s (settle_timeout_s): {blocker.detail}"
            )

    def warn(self, blocker: settling.Blocker, delay: float, what: str, unsettled: int) -> None:
        """Say once per reason that this leader cannot settle (``what`` is written again in
        ``delay`` seconds), then export it and end the process on time (``block``)."""
        if self.said != blocker.reason:
            log.warning(
                "cannot settle: %s; publishing nothing new until %s written (again in %.1fs; exit after %gs)",
                blocker.detail,
                what,
                delay,
                self.settle_timeout_s,
                extra={
                    "event": "cannot_settle",
                    "role": "leader",
                    "reason": blocker.reason,
                    "detail": blocker.detail,
                    "unsettled": unsettled,
                    "retry_in_s": round(delay, 3),
                },
            )
        self.block(blocker)

    def stand_by(self, blocker: settling.Blocker | None) -> None:
        """Say why this drain stands by (``blocker``, or None: another drain leads), once per
        change of reason."""
        if blocker is None:
            self.since = None
            if self.said == ANOTHER_LEADS:
                return
            if self.said is not None:
                self.metrics.set_cannot_settle(None)
            self.said = ANOTHER_LEADS
            log.info(
                "standing by: another drain leads %s",
                self._table,
                extra={"event": "standing_by", "role": "standby", "table": self._table},
            )
            return
        if self.said != blocker.reason:
            log.warning(
                "standing by: %s",
                blocker.detail,
                extra={
                    "event": "standing_by",
                    "role": "standby",
                    "table": self._table,
                    "reason": blocker.reason,
                    "detail": blocker.detail,
                },
            )
        self.block(blocker)

    def settles_again(self, unsettled: int) -> None:
        """A step committed after this drain could not settle: say so once, clear the reason."""
        if self.said not in (None, ANOTHER_LEADS):
            log.info(
                "settling again: published jobs are deleted",
                extra={"event": "settling_again", "role": "leader", "reason": self.said},
            )
        self.said = None
        self.since = None
        self.metrics.set_cannot_settle(None)
        self.metrics.set_unsettled(unsettled)

    def forget(self) -> None:
        """Leadership lost: the next turn that finds another drain leading (or a reason) says so."""
        self.said = None
        self.since = None
        self.metrics.set_cannot_settle(None)
