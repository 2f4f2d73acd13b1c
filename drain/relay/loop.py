"""The relay: the follower/leader loop.

::

                 ┌──────────── lock taken by another: wait standby_retry_s ± jitter ──┐
                 ▼                                                                     │
    start ──► FOLLOWER ──pg_try_advisory_lock wins──► LEADER ──────────────────────────┘
                 ▲                                      │  a step (drain.relay.step):
                 │ database error / lock lost:          │    BEGIN REPEATABLE READ; verify the lock
                 │ close adapters and session,          │    select due rows in id order
                 └─ back off, reconnect ◄───────────────┤    forward them (dispatch), collect flights due
                                                        │    settle: delete / retry / dead-letter
                 stop event ──► finish the step, settle  │    COMMIT (a 40001 rewrites the settlement
                 what is in flight, release, close      │    in a fresh fenced transaction)
                                                        └─ full batch: again at once; else wait
                                                           (poll backoff, or the next run_at),
                                                           armed: a producer's commit wakes it

Settle or do not publish (drain.relay.settling): a standby leads only where its session can settle
(not a standby server, not read-only, the privileges, the probe of the table). A step whose
settlement fails keeps its jobs (Unsettled, their rows excluded from selection); the loop then
only tries to write it, with backoff, publishing nothing new, and ends the process
(CannotSettle, exit 6) once it failed for ``settle_timeout_s`` (drain.relay.blockage). Rows a
pipelined batch published in an earlier transaction that an app holds a lock on are settled by a
later step rather than waited for.

Where each concern lives: the step, the one place that orders store and adapter calls —
drain.relay.step; every adapter call with its failures translated — drain.relay.dispatch; which
backends are open or paused — drain.relay.availability; batches awaiting broker confirms —
drain.relay.pipeline; what the per-job results mean for the rows — drain.relay.settlement (pure);
writing them — drain.relay.writing, the rows the table refuses — drain.relay.refusals; what a step
did, counted and logged — drain.relay.reporting; every SQL statement — drain.store.session; the
lock — drain.relay.leadership; why this drain cannot settle, and for how long —
drain.relay.blockage; the loop's waits — drain.relay.pacing (each growing by drain.relay.backoff);
a loop that stopped making progress — drain.relay.watchdog; periodic jobs staged once per tick —
drain.relay.schedules (before each step); the idle leader woken by a producer's commit —
drain.relay.wakeup (armed after a step, disarmed before the next).

drain_step() is what the loop runs; drain_once() is a step that leaves nothing in flight (the
SPEC's one-transaction batch, and what ``pipeline_depth = 0`` runs); drain_due() is ``drain run
--once``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping

import psycopg

from drain import errors
from drain.backend import Adapter
from drain.config import settings as config
from drain.observability import metrics
from drain.relay import (
    blockage,
    dispatch,
    failpoints,
    leadership,
    pacing,
    schedules,
    settling,
    step,
    term,
    wakeup,
)
from drain.relay.reporting import BatchReport
from drain.relay.watchdog import Watchdog
from drain.store import session as store

__all__ = ["BatchReport", "Relay"]

log = logging.getLogger(__name__)


class Relay:
    """Forwards one staged-jobs table to its backends. Use from one thread."""

    def __init__(
        self,
        settings: config.Settings,
        adapters: Mapping[str, Adapter],
        *,
        db: store.Store | None = None,
        metrics_: metrics.Metrics | None = None,
        failpoints_: failpoints.Failpoints | None = None,
        watchdog: Watchdog | None = None,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self.store = db or store.Store(settings)
        self.leadership = leadership.Leadership(self.store)
        self.scheduler = schedules.Scheduler(settings, self.store, self.leadership, clock=clock)
        self.metrics = metrics_ or metrics.Metrics()
        self.metrics.know(backends=adapters, queues=(schedule.queue for schedule in settings.schedules))
        self.failpoints = failpoints_ or failpoints.Failpoints()
        self.gate = dispatch.BackendGate(
            adapters,
            metrics_=self.metrics,
            failpoints_=self.failpoints,
            clock=clock,
            rand=jitter,
            step_budget_s=settings.publish_timeout_s / 2,
        )
        self.watchdog = watchdog
        notify = settings.wakeup == config.WAKEUP_NOTIFY
        self.wakeup = wakeup.Wakeup(self.store, metrics_=self.metrics) if notify else None
        self.blockage = blockage.Blockage(settings, self.metrics, clock, self.store.names.qualified)
        self.stepper = step.Stepper(
            settings,
            self.store,
            self.leadership,
            self.gate,
            metrics_=self.metrics,
            failpoints_=self.failpoints,
            blockage_=self.blockage,
            clock=clock,
            jitter=jitter,
        )
        self.pacing = pacing.Pacing(settings, jitter, self.failpoints)
        self.term = term.Term(self.stepper)
        self.figures_refresh_s = metrics.REFRESH_S
        self._figures_at = float("-inf")
        self._clock = clock

    @property
    def in_flight(self) -> int:
        """Jobs submitted by earlier pipelined steps whose acknowledgements are not settled yet."""
        return self.stepper.flights.jobs

    @property
    def unsettled(self) -> settling.Unsettled:
        """Jobs handed to their backend whose settlement is not written yet."""
        return self.stepper.unsettled

    # --- the loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Follow or lead until ``stop`` is set; then finish the step, release, close."""
        try:
            while not stop.is_set():
                wait = self.turn()
                if self.wakeup is not None and self.wakeup.armed:
                    self.wakeup.sleep(wait, stop)
                else:
                    stop.wait(wait)
        finally:
            self.shutdown()

    def turn(self) -> float:
        """Go round the loop once: lead (a step) or stand by; return how long to wait next. While
        this drain cannot settle, never past the moment settle_timeout_s runs out: the turn then
        tries once more and ends the process (CannotSettle) on time, not a backoff later."""
        return self.blockage.cap(self._turn())

    def _turn(self) -> float:
        """Lead, select, forward, settle (a step); return the wait that pacing calls for."""
        self.metrics.tick()
        if self.watchdog is not None:
            self.watchdog.pet()
        try:
            if self.wakeup is not None:
                self.wakeup.disarm()  # awake: producers stop notifying
            if not self.leadership.is_leader and not self.lead():
                self.blockage.stand_by(self.leadership.blocker)
                return self.pacing.standby_s()
            if self.unsettled.failing:  # a settlement failed: only that, until it is written
                wait = self.stepper.settle_again()
                if not self.unsettled.failing:
                    self.pacing.connected()
                return wait
            self.scheduler.stage_due()  # its own fenced transaction, only when a tick may be due
            report = self.drain_step()
            self.stepper.held_too_many()
            if self.unsettled.failing:
                return self.unsettled.wait_s()
            self.refresh_figures()
            self.pacing.connected()
            in_flight = bool(self.stepper.flights)
            return self.pacing.after(
                report, self.wakeup, in_flight=in_flight, due_in=self._due_in, holding=self._holding
            )
        except (errors.PoolerDetected, errors.CannotSettle):
            raise
        except (psycopg.Error, errors.DrainError) as exc:
            if self.wakeup is not None:
                self.wakeup.forget()  # the session goes, and the wake lock and the LISTEN with it
            self.term.step_down(exc)
            return self.pacing.reconnect_s()

    def _due_in(self) -> tuple[float | None, ...]:
        """Seconds until the next schedule tick, the earliest future row, a held row's next try."""
        return (self.scheduler.wait_s(), self.store.seconds_until_due(), self.unsettled.next_try_s())

    def _holding(self) -> bool:
        """Rows due but not selectable (a paused backend's, or held: Unsettled): do not arm."""
        return bool(self.gate.paused()) or bool(self.unsettled)

    # --- a step -----------------------------------------------------------------------------

    def drain_once(self) -> BatchReport:
        """Forward one whole batch of due rows; the caller must be the leader. BEGIN REPEATABLE
        READ, verify the lock, select, publish, wait for every acknowledgement, delete the
        acknowledged ids, record failures, COMMIT. Batches left in flight by drain_step are
        collected and settled first, in the same transaction. Database errors and LeadershipLost
        propagate: the batch rolled back and nothing was deleted."""
        return self.stepper.step(depth=0, limit=self.settings.batch_size)

    def drain_step(self) -> BatchReport:
        """One step of the pipelined loop (``pipeline_depth``); the caller must be the leader.
        Like drain_once, except that a pipelined backend's jobs are only submitted: up to
        ``pipeline_depth`` batches await their acknowledgements while the relay selects and
        submits the next ones, and each is collected and settled by a later step's transaction
        (the next step that finds no rows settles them all; any step, those older than
        drain.relay.pipeline.MAX_AGE_S). If the process dies in between, the rows in flight were
        not deleted and go again: duplicates, never a loss."""
        return self.stepper.step(depth=self.settings.pipeline_depth, limit=self.settings.batch_size)

    def settle_in_flight(self) -> BatchReport:
        """Collect and settle every batch in flight, selecting nothing new."""
        return self.stepper.step(depth=0, limit=0)

    def drain_due(self, stop: threading.Event) -> BatchReport | None:
        """Lead, then forward what is due now, a whole batch at a time (drain_once), until no row
        is due, only those of unavailable backends are left, or ``stop`` is set; return the
        totals (None: another drain leads). Schedules are not staged. Raises CannotSettle at
        once where the loop would wait: this drain cannot lead here (any reason), or a
        settlement failed."""
        if not self.lead():
            if self.leadership.blocker is not None:
                raise errors.CannotSettle(f"cannot lead here: {self.leadership.blocker.detail}")
            return None
        total = BatchReport()
        while not stop.is_set():
            if self.watchdog is not None:
                self.watchdog.pet()
            report = self.drain_once()
            if self.unsettled.failing:
                raise errors.CannotSettle(
                    f"{self.unsettled.jobs} published jobs could not be settled (deleted); "
                    "they will be forwarded again"
                )
            total.add(report)
            # again after an empty select that looked only at its window (reading.FULL_EVERY)
            if report.again or not (report.selected or self.store.reader.looked_everywhere):
                continue
            if report.selected in (0, report.skipped):
                break
        return total

    # --- leading, figures, shutdown --------------------------------------------------------

    def lead(self) -> bool:
        """Take the lock if free and this drain can settle here; say so (drain.relay.term)."""
        if not self.term.begin():
            return False
        self._figures_at = float("-inf")
        return True

    def refresh_figures(self, *, force: bool = False) -> None:
        """As leader, export the table's gauges; at most every ``figures_refresh_s``, capped counts."""
        now = self._clock()
        if not force and now - self._figures_at < self.figures_refresh_s:
            return
        self._figures_at = now
        figures = self.store.status(metrics.COUNT_CAP, key_cap=metrics.KEY_COUNT_CAP)
        figures["read_at"] = time.time()
        self.metrics.set_figures(figures)

    def shutdown(self) -> None:
        """Settle the batches in flight, release the lock and close every connection. Idempotent."""
        self.term.end()
        if self.wakeup is not None:
            self.wakeup.forget()  # closing the session released the wake lock
