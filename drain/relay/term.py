"""A leader's term: how it begins, and how it ends — stepping down after an error, or released
at shutdown — with what each transition opens, settles, clears, closes and says.

::

    begin:      the lock taken (drain.relay.leadership: only where this drain can settle), the
                table there: "leading", drain_leader 1, a warning if row-level security applies
    step down:  a database error or the lock lost: the batches in flight are forgotten (their rows
                were not deleted: the next leader forwards them again), and the reason said; the
                backends and the session closed
    end:        the batches in flight and the settlements held are settled, else said to go
                again; the lock released, the backends and the session closed
"""

from __future__ import annotations

import logging

from drain import errors
from drain.relay import step

log = logging.getLogger(__name__)


class Term:
    """The transitions of a leader's term, over the parts of its steps; use from one thread."""

    def __init__(self, stepper: step.Stepper) -> None:
        self.stepper = stepper
        self.store = stepper.store
        self.leadership = stepper.leadership
        self.gate = stepper.gate
        self.blockage = stepper.blockage
        self.metrics = stepper.metrics
        self.failpoints = stepper.failpoints

    def begin(self) -> bool:
        """Take the lock if free and this drain can settle here; say so."""
        if not self.leadership.try_acquire():
            return False
        self.store.require_table()
        self.failpoints.hit("after_lock")
        table = self.store.names.qualified
        log.info(
            "leading %s (backend pid %s)",
            table,
            self.leadership.pid,
            extra={"event": "leading", "role": "leader", "table": table, "backend_pid": self.leadership.pid},
        )
        self.metrics.set_leader(True)
        if self.leadership.row_security is not None:
            log.warning(
                "warning: %s",
                self.leadership.row_security,
                extra={"event": "row_security", "role": "leader", "table": table},
            )
        return True

    def step_down(self, exc: BaseException) -> None:
        """The database failed the turn (``exc``): no longer leader, every connection closed."""
        was_leader = self.leadership.is_leader
        in_flight = self.stepper.flights.jobs
        self.stepper.flights.clear()  # not deleted: the next leader forwards them again
        self.metrics.set_in_flight(0)
        reason = errors.first_line(exc)
        log.warning(
            "%s: %s",
            "lost leadership" if was_leader else "database error",
            reason,
            extra={
                "event": "lost_leadership" if was_leader else "database_error",
                "role": "standby",
                "reason": reason,
                "in_flight_dropped": in_flight,
            },
        )
        self.blockage.forget()  # the next turn that finds another drain leading (or a reason) says so
        self.leadership.forget()
        self.gate.close_all()
        self.store.close()
        if was_leader:
            self.metrics.set_leader(False)

    def end(self) -> None:
        """Settle the batches in flight, release the lock and close every connection. Idempotent."""
        if (self.stepper.flights or self.stepper.unsettled) and self.leadership.is_leader:
            self._settle_before_exit()
        if self.leadership.is_leader:
            self.leadership.release()
            self.metrics.set_leader(False)
            log.info(
                "released leadership",
                extra={"event": "released", "role": "standby", "table": self.store.names.qualified},
            )
        self.gate.close_all()
        self.store.close()

    def _settle_before_exit(self) -> None:
        unsettled = self.stepper.unsettled
        in_flight = self.stepper.flights.jobs + unsettled.jobs  # a failed step drops them from the books
        reason = "the settlement failed"
        failed = False
        try:
            self.stepper.step(depth=0, limit=0)  # Relay.settle_in_flight
        except Exception as exc:  # noqa: BLE001 - its rows stay staged and go again
            reason, failed = errors.first_line(exc), True
        if failed or self.stepper.flights or unsettled:
            log.warning(
                "could not settle the last %d jobs handed over; they will be forwarded again: %s",
                in_flight,
                reason,
                extra={"event": "settle_failed", "in_flight": in_flight, "reason": reason},
            )
        self.stepper.flights.clear()
        unsettled.clear()
        self.metrics.set_in_flight(0)
        self.metrics.set_unsettled(0)
