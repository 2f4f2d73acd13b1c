"""The relay: one loop in two states, and a leader's step.

The two states:
    - follow (``Relay._follow``): another drain leads, or this one cannot lead here. Say why; wait.
    - lead (``Relay._lead``): a step, then the wait pacing calls for. A term begins with
      ``begin_term``. It ends with ``step_down`` (an error) or ``shutdown`` (stopped).

The four moves of a step (``Relay._step``), in one fenced transaction:
    1. select: ``Relay._select``, on drain.store.session.Batch.select_due;
    2. forward: ``Relay._forward``, on drain.relay.forward.Forwarder.forward;
    3. settle: drain.relay.settle.Settler.settle;
    4. commit: the batch's block ends. Then drain.relay.settle.Settler.committed, and
       drain.relay.reporting.record counts and logs the step.

The loop::

                 ┌──────────── lock taken by another: wait standby_retry_s ± jitter ──┐
                 ▼                                                                     │
    start ──► FOLLOW ──pg_try_advisory_lock wins, the table settles──► LEAD ───────────┘
                 ▲                                                      │  a step, then a wait
                 │ database error / lock lost: close adapters and       │
                 └─ session, back off, reconnect ◄──────────────────────┘

When a step fails:
    - Before anything was published, it rolls back. A 40001 at the select looks again at once.
    - After, the Settler writes the settlement again in a fresh fenced transaction.
    - If that fails too, its jobs are held. The leader only tries that again, forwarding nothing
      new, until settle_timeout_s ends the process (exit 6).

The entry points:
    - ``drain_step()``: what the loop runs; up to ``pipeline_depth`` batches stay in flight;
    - ``drain_once()``: a step that leaves nothing in flight (the SPEC's one-transaction batch);
    - ``settle_in_flight()``: collect and settle the flights, selecting nothing new;
    - ``drain_due(stop)``: ``drain run --once``.

Around the loop: drain.relay (the package's docstring).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping

import psycopg

from drain import errors, models
from drain.backend import Adapter
from drain.config import settings as config
from drain.observability import metrics
from drain.relay import failpoints, forward, lanes, pacing, reporting, schedules, settle, wakeup
from drain.relay.watchdog import Watchdog
from drain.store import session as store

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
        self.metrics = metrics_ or metrics.Metrics()
        self.leadership = lanes.leadership_for(self.store, settings, clock, self.metrics)
        self.scheduler = schedules.Scheduler(settings, self.store, self.leadership, clock=clock)
        self.metrics.know(backends=adapters, queues=(schedule.queue for schedule in settings.schedules))
        self.failpoints = failpoints_ or failpoints.Failpoints()
        self.forwarder = forward.Forwarder(
            adapters,
            metrics_=self.metrics,
            failpoints_=self.failpoints,
            clock=clock,
            rand=jitter,
            step_budget_s=settings.publish_timeout_s / 2,
            fence_s=config.batch_fence_s(settings.publish_timeout_s),
        )
        self.watchdog = watchdog
        notify = settings.wakeup == config.WAKEUP_NOTIFY
        self.wakeup = wakeup.Wakeup(self.store, metrics_=self.metrics) if notify else None
        self.settler = settle.Settler(
            settings,
            self.store,
            self.leadership,
            metrics_=self.metrics,
            failpoints_=self.failpoints,
            paused=self.forwarder.paused,
            clock=clock,
            jitter=jitter,
        )
        self.pacing = pacing.Pacing(settings, jitter, self.failpoints)
        self.figures_refresh_s = metrics.REFRESH_S
        self._figures_at = float("-inf")
        self._clock = clock

    @property
    def in_flight(self) -> int:
        """Jobs submitted by earlier pipelined steps, not settled yet."""
        return self.forwarder.in_flight

    # --- the loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Follow or lead until ``stop`` is set; then finish the step, release, close."""
        try:
            while not stop.is_set():
                wait = self.turn()
                if self.watchdog is not None:
                    self.watchdog.pet(wait)  # idle is not stuck: the bound counts after the wait
                if self.wakeup is not None and self.wakeup.armed:
                    self.wakeup.sleep(wait, stop)
                else:
                    stop.wait(wait)
        finally:
            self.shutdown()

    def turn(self) -> float:
        """Go round the loop once, following or leading; return how long to wait next.

        While this drain cannot settle, the wait never passes the moment settle_timeout_s runs
        out: the next turn then ends the process (CannotSettle) on time.
        """
        self.metrics.tick()
        if self.watchdog is not None:
            self.watchdog.pet()
        try:
            if self.wakeup is not None:
                self.wakeup.disarm()  # awake: producers stop notifying
            wait = self._lead() if self.leadership.is_leader or self.begin_term() else self._follow()
        except (errors.PoolerDetected, errors.CannotSettle, errors.ConfigError):
            raise  # the process ends: reconnecting cannot help
        except (psycopg.Error, errors.DrainError) as exc:
            if self.wakeup is not None:
                self.wakeup.forget()  # the session goes, and the wake lock and the LISTEN with it
            self.step_down(exc)
            wait = self.pacing.reconnect_s()
        return self.settler.cap(wait)

    def _follow(self) -> float:
        """The following state: another drain leads, or this one cannot lead here. Say why; wait."""
        self.settler.stand_by(self.leadership.blocker)
        return self.pacing.standby_s()

    def _lead(self) -> float:
        """The leading state: a step, then the wait pacing calls for. While a settlement is
        failing, only that settlement is tried again, when its backoff is up."""
        failing = self.settler.held.failing
        if failing:
            wait = self.settler.retry_wait_s()
            if wait > 0:
                return wait
            self.settle_in_flight()
        else:
            self.leadership.balance(self._settled)  # with lanes: take a fair share, hand some over
            self.scheduler.stage_due()  # its own fenced transaction, only when a tick may be due
            report = self.drain_step()
        self.settler.check_crowded()
        if self.settler.held.failing:
            return self.settler.held.wait_s()
        if failing:
            self.pacing.connected()
            return 0.0
        self.refresh_figures()
        self.pacing.connected()
        return self.pacing.after(
            report,
            self.wakeup,
            in_flight=self.forwarder.has_flights,
            due_in=self._due_in,
            holding=self._holding,
        )

    def _due_in(self) -> tuple[float | None, ...]:
        """Seconds until the next schedule tick, the earliest future row, a held row's next try,
        the next balance of the lanes."""
        held, balance = self.settler.held.next_try_s(), self.leadership.balance_in_s()
        return (self.scheduler.wait_s(), self.store.seconds_until_due(), held, balance)

    def _settled(self) -> bool:
        """Settle every batch in flight; whether none is left, nor a held settlement."""
        self.settle_in_flight()
        return not (self.forwarder.has_flights or self.settler.held)

    def _holding(self) -> bool:
        """Rows due but not selectable (a paused backend's, or held): do not arm."""
        return bool(self.forwarder.paused()) or bool(self.settler.held)

    # --- a step -----------------------------------------------------------------------------

    def drain_once(self) -> reporting.BatchReport:
        """Forward one whole batch of due rows, in one transaction; the caller must be the leader.

        - It waits for every acknowledgement before it deletes: nothing stays in flight.
        - Batches left in flight by drain_step are collected and settled first, in the same
          transaction.
        - Database errors and LeadershipLost propagate: the batch rolled back, nothing was deleted.
        """
        return self._step(depth=0, limit=self.settings.batch_size)

    def drain_step(self) -> reporting.BatchReport:
        """One step of the pipelined loop; the caller must be the leader.

        - Like drain_once, but a pipelined backend's jobs are only submitted: up to
          ``pipeline_depth`` batches await their confirms (drain.relay.forward, Flights).
        - A step that finds no rows settles them all.
        - If the process dies meanwhile, their rows were not deleted and go again: duplicates,
          never a loss.
        """
        return self._step(depth=self.settings.pipeline_depth, limit=self.settings.batch_size)

    def settle_in_flight(self) -> reporting.BatchReport:
        """Collect and settle every batch in flight, selecting nothing new."""
        return self._step(depth=0, limit=0)

    def drain_due(self, stop: threading.Event) -> reporting.BatchReport | None:
        """Lead, then forward what is due now, in steps of the pipelined loop (drain_step).

        - It stops when no row is due, only those of unavailable backends are left, or ``stop``
          is set; the batches still in flight are settled first. It returns the totals (None:
          another drain leads).
        - Schedules are not staged.
        - Where the loop would wait, it raises CannotSettle at once: this drain cannot lead here
          (any reason), or a settlement failed.
        """
        if not self.begin_term():
            if self.leadership.blocker is not None:
                raise errors.CannotSettle(f"cannot lead here: {self.leadership.blocker.detail}")
            return None
        total = reporting.BatchReport()
        while not stop.is_set():
            if self.watchdog is not None:
                self.watchdog.pet()
            report = self.drain_step()
            self._settled_or_raise(report, total)
            # again after an empty select that looked only at its window (reading.FULL_EVERY)
            if report.again or not (report.selected or self.store.reader.looked_everywhere):
                continue
            # a step that collected flights may have freed keyed rows held back behind them
            if report.selected in (0, report.skipped) and not report.collected:
                break
        if self.forwarder.has_flights:
            self._settled_or_raise(self.settle_in_flight(), total)
        return total

    def _settled_or_raise(self, report: reporting.BatchReport, total: reporting.BatchReport) -> None:
        """Add a step's report to ``total``; CannotSettle when a settlement failed."""
        if self.settler.held.failing:
            raise errors.CannotSettle(
                f"{self.settler.held.jobs} published jobs could not be settled (deleted); "
                "they will be forwarded again"
            )
        total.add(report)

    # --- a step: select, forward, settle, commit ----------------------------------------------

    def _step(self, *, depth: int, limit: int) -> reporting.BatchReport:
        """Select up to ``limit`` rows, forward them leaving up to ``depth`` batches in flight,
        and settle what is due, in one fenced transaction (the module docstring). A step that
        raises forgets every flight: their rows were not deleted, and go again."""
        try:
            return self._select_forward_settle(depth=depth, limit=limit)
        except BaseException:
            self.forwarder.forget_flights()
            raise

    def _select_forward_settle(self, *, depth: int, limit: int) -> reporting.BatchReport:
        """The four moves, numbered as in the module docstring."""
        started = time.perf_counter()
        held_due, held_results = self.settler.held.pending()  # settled by this step, or kept
        self.forwarder.begin_step()
        report = reporting.BatchReport()
        to_settle: settle.ToSettle | None = None
        try:
            with self.store.batch(relaxed=True) as batch:
                self.leadership.verify(batch)
                jobs = self._select(batch, limit, report)  # 1
                if not jobs and not self.forwarder.has_flights and not held_due:
                    return report
                to_settle = self._forward(jobs, held_due, held_results, depth=depth, report=report)  # 2
                written = self.settler.settle(batch, to_settle)  # 3
            # 4: the block ended, the batch committed
        except (psycopg.Error, errors.SettlementRefused, errors.SelectAgain) as exc:
            if to_settle is None:
                if not isinstance(exc, psycopg.errors.SerializationFailure | errors.SelectAgain):
                    raise
                report.again = True  # a row an app changed, the lanes function failed: none published
                return report
            assert not isinstance(exc, errors.SelectAgain)  # only the select raises it
            again = self.settler.recover(exc, to_settle)
            if again is None:
                return report
            written = again
        assert to_settle is not None
        self.settler.committed(held_due, written, to_settle.results)
        self.failpoints.hit("after_commit")
        reporting.record(
            self.metrics,
            written,
            report,
            time.perf_counter() - started,
            in_flight=self.forwarder.in_flight,
            unsettled=self.settler.held.jobs,
        )
        return report

    def _select(
        self, batch: store.Batch, limit: int, report: reporting.BatchReport
    ) -> list[models.StagedJob]:
        """Select up to ``limit`` due rows: not those in flight or held, not a paused backend's,
        within batch_max_bytes less what is in flight."""
        held = self.settler.held
        exclude = self.forwarder.in_flight_ids() + held.row_ids()
        budget = self.settings.batch_max_bytes - self.forwarder.in_flight_bytes
        jobs = batch.select_due(limit, self.forwarder.paused(), exclude, budget)
        report.selected = len(jobs)
        report.full = limit > 0 and (len(jobs) >= limit or batch.over_budget)
        if not jobs and not self.forwarder.has_flights and held.failing and not held:
            # Nothing left to write: the failed step's rows were all in flight, gone with its
            # session (a new term), so "failing" must end here, or the loop would retry nothing
            # at full speed forever.
            held.settled((), (), (), {})
        if jobs:
            self.failpoints.hit("after_select")
        return jobs

    def _forward(
        self,
        jobs: list[models.StagedJob],
        held_due: list[models.StagedJob],
        held_results: dict[int, models.PublishResult],
        *,
        depth: int,
        report: reporting.BatchReport,
    ) -> settle.ToSettle:
        """Forward ``jobs`` and collect the flights due; return what to settle."""
        results, submitted = self.forwarder.forward(jobs, submit=depth > 0, full=report.full)
        # Partial batches stay in flight too: waiting for their confirms before the next select
        # put the broker's confirm latency into every job's (p50 23 ms instead of 5 at 2,000/s).
        collected, given_up, answers = self.forwarder.collect_due(keep=depth if jobs else 0)
        report.collected = sum(len(flight.jobs) for flight in collected)
        collected += given_up  # what the broker confirmed of them counts
        results.update(answers)
        self.failpoints.hit("after_publish")
        submitted_ids = {job.id for flight in submitted for job in flight.jobs}
        collected_jobs = [job for flight in collected for job in flight.jobs]
        answered = [job for job in jobs if job.id not in submitted_ids] + collected_jobs
        untouched = results.keys() | set(self.forwarder.in_flight_ids())
        report.skipped = sum(1 for job in answered if job.id not in untouched)
        results.update(held_results)
        return settle.ToSettle(
            jobs=answered + held_due,
            results=results,
            unlocked=[job.id for job in collected_jobs],
            suspect=[job.id for job in held_due],
            busy=self.forwarder.in_flight_ids() + self.settler.held.row_ids(),
        )

    # --- figures ------------------------------------------------------------------------------

    def refresh_figures(self, *, force: bool = False) -> None:
        """As leader, export the table's gauges; at most every ``figures_refresh_s``, capped counts."""
        now = self._clock()
        if not force and now - self._figures_at < self.figures_refresh_s:
            return
        self._figures_at = now
        figures = lanes.figures(self.store, self.leadership)  # with lanes, lane 0's leader adds each lane's
        figures["read_at"] = time.time()
        self.metrics.set_figures(figures)

    # --- a term: begun, stepped down, ended -------------------------------------------------

    def begin_term(self) -> bool:
        """Take the lock if free and this drain can settle here; say so."""
        if not self.leadership.try_acquire():
            return False
        self.store.require_table()
        self.failpoints.hit("after_lock")
        table = self.store.names.qualified
        pid = self.leadership.pid
        extra = {"event": "leading", "role": "leader", "table": table, "backend_pid": pid}
        log.info("leading %s (backend pid %s)", table, pid, extra=extra)
        self.metrics.set_leader(True)
        self.settler.forget_blocker()  # what kept it standing by (a lane count, a schema) is gone
        if self.leadership.row_security is not None:
            log.warning(
                "warning: %s",
                self.leadership.row_security,
                extra={"event": "row_security", "role": "leader", "table": table},
            )
        self._figures_at = float("-inf")
        return True

    def step_down(self, exc: BaseException) -> None:
        """The database failed the turn (``exc``): no longer leader, every connection closed."""
        was_leader = self.leadership.is_leader
        in_flight = self.forwarder.in_flight
        self.forwarder.forget_flights()  # not deleted: the next leader forwards them again
        self.metrics.set_in_flight(0)
        reason = errors.first_line(exc)
        event = "lost_leadership" if was_leader else "database_error"
        extra = {"event": event, "role": "standby", "reason": reason, "in_flight_dropped": in_flight}
        log.warning("%s: %s", event.replace("_", " "), reason, extra=extra)
        self.settler.forget_blocker()
        self.leadership.forget()
        self.forwarder.close_all()
        self.store.close()
        if was_leader:
            self.metrics.set_leader(False)

    def shutdown(self) -> None:
        """End the term: settle the batches in flight, release the lock, close every connection.
        Idempotent."""
        if (self.forwarder.has_flights or self.settler.held) and self.leadership.is_leader:
            self._settle_before_exit()
        if self.leadership.is_leader:
            self.leadership.release()
            self.metrics.set_leader(False)
            log.info(
                "released leadership",
                extra={"event": "released", "role": "standby", "table": self.store.names.qualified},
            )
        self.forwarder.close_all()
        self.store.close()
        if self.wakeup is not None:
            self.wakeup.forget()  # closing the session released the wake lock

    def _settle_before_exit(self) -> None:
        held = self.settler.held
        in_flight = self.forwarder.in_flight + held.jobs  # a failed step drops them from the books
        reason = "the settlement failed"
        failed = False
        try:
            self.settle_in_flight()
        except Exception as exc:  # noqa: BLE001 - its rows stay staged and go again
            reason, failed = errors.first_line(exc), True
        if failed or self.forwarder.has_flights or held:
            log.warning(
                "could not settle the last %d jobs handed over; they will be forwarded again: %s",
                in_flight,
                reason,
                extra={"event": "settle_failed", "in_flight": in_flight, "reason": reason},
            )
        self.forwarder.forget_flights()
        held.clear()
        self.metrics.set_in_flight(0)
        self.metrics.set_unsettled(0)
