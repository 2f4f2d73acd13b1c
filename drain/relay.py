"""The relay: the follower/leader loop, and the batch step, the one place that orders store and
adapter calls.

::

                 ┌──────────── lock taken by another: wait standby_retry_s ± jitter ──┐
                 ▼                                                                     │
    start ──► FOLLOWER ──pg_try_advisory_lock wins──► LEADER ──────────────────────────┘
                 ▲                                      │  a step (_step):
                 │ database error / lock lost:          │    BEGIN REPEATABLE READ; verify the lock
                 │ close adapters and session,          │    select due rows in id order
                 └─ back off, reconnect ◄───────────────┤    forward them (gate), collect flights due
                                                        │    settle: delete / retry / dead-letter
                 stop event ──► finish the step, settle  │    COMMIT (a 40001 rewrites the settlement
                 what is in flight, release, close      │    in a fresh fenced transaction)
                                                        └─ full batch: again at once; else wait
                                                           (poll backoff, or the next run_at),
                                                           armed: a producer's commit wakes it

Where each concern lives: which backends are open or paused, and every adapter call with its
failures translated — drain.gate; batches awaiting broker confirms — drain.pipeline; what the
per-job results mean for the rows — drain.settlement (pure); every SQL statement — drain.store;
the lock — drain.leadership; growing waits — drain.backoff; a loop that stopped making progress
— drain.watchdog; periodic jobs staged once per tick — drain.schedules (before each step); the
idle leader woken by a producer's commit — drain.wakeup (armed after a step, disarmed before the next).

drain_step() is what the loop runs; drain_once() is a step that leaves nothing in flight (the
SPEC's one-transaction batch, and what ``pipeline_depth = 0`` runs).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping

import psycopg

from drain import (
    backoff,
    config,
    errors,
    failpoints,
    gate,
    leadership,
    logs,
    metrics,
    models,
    pipeline,
    schedules,
    settlement,
    store,
    wakeup,
)
from drain.backend import Adapter
from drain.watchdog import Watchdog

log = logging.getLogger(__name__)

RECONNECT_MIN_S = 0.5
BUSY_MIN_S = 0.001  # a producer's transaction is open: its commit is likely a moment away
RECONNECT_MAX_S = 10.0
SERIALIZATION_RETRIES = 5


@dataclasses.dataclass
class BatchReport:
    """What one step (drain_once, drain_step, settle_in_flight) did."""

    selected: int = 0
    published: int = 0
    retried: int = 0
    rejected: int = 0
    dead: int = 0
    skipped: int = 0
    full: bool = False


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
        self.failpoints = failpoints_ or failpoints.Failpoints()
        self.gate = gate.BackendGate(
            adapters, metrics_=self.metrics, failpoints_=self.failpoints, clock=clock, rand=jitter
        )
        self.watchdog = watchdog
        notify = settings.wakeup == config.WAKEUP_NOTIFY
        self.wakeup = wakeup.Wakeup(self.store, metrics_=self.metrics) if notify else None
        self.figures_refresh_s = metrics.REFRESH_S
        self._clock = clock
        self._flights = pipeline.InFlight(clock=clock)
        self._retry_backoff = backoff.Backoff(settings.retry_base_s, settings.retry_max_s, jitter)
        self._idle = backoff.Streak(backoff.Backoff(settings.poll_min_s, settings.poll_max_s, jitter))
        armed_max_s = max(settings.poll_max_s, settings.wakeup_poll_max_s)
        self._armed_idle = backoff.Backoff(settings.poll_min_s, armed_max_s, jitter)
        self._busy = backoff.Streak(backoff.Backoff(BUSY_MIN_S, settings.poll_max_s, jitter))
        self._reconnects = backoff.Streak(backoff.Backoff(RECONNECT_MIN_S, RECONNECT_MAX_S, jitter))
        standby_s = settings.standby_retry_s * 1.5  # jittered to 0.75-1.5 x standby_retry_s
        self._standby = backoff.Backoff(standby_s, standby_s, jitter)
        self._figures_at = float("-inf")
        self._max_attempts = {name: section.max_attempts for name, section in settings.backends.items()}
        self._standing_by = False  # logged once per turn from leader (or start) to standby

    @property
    def in_flight(self) -> int:
        """Jobs submitted by earlier pipelined steps whose acknowledgements are not settled yet."""
        return self._flights.jobs

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
        """Go round the loop once: lead (a step) or stand by; return how long to wait next."""
        self.metrics.tick()
        if self.watchdog is not None:
            self.watchdog.pet()
        try:
            if self.wakeup is not None:
                self.wakeup.disarm()  # awake: producers stop notifying
            if not self.leadership.is_leader and not self._try_lead():
                self._stand_by()
                return self._standby.delay(1)
            self.scheduler.stage_due()  # its own fenced transaction, only when a tick may be due
            report = self.drain_step()
            self.refresh_figures()
            self._reconnects.reset()
            return self._pause_after(report)
        except errors.PoolerDetected:
            raise
        except (psycopg.Error, errors.DrainError) as exc:
            self._step_down(exc)
            return self._reconnects.next()

    def _pause_after(self, report: BatchReport) -> float:
        """Full batch or batches in flight: at once (the next step settles what is in flight if
        it finds nothing new). Partial: the shortest poll. Idle: back off, but wake when the
        earliest future row falls due (the database's clock says when).

        With the wake-up on, a partial or empty step arms it (drain.wakeup): a producer's commit
        ends the wait, which is then only the safety net, so an idle one backs off further, to
        wakeup_poll_max_s, while no notification was missed. When a producer's open transaction
        refuses the arming, the leader looks again after BUSY_MIN_S, backing off. Not while a
        backend is paused: its rows are due but not selectable, so "anything due?" would always
        say yes."""
        if report.full or self._flights:
            self._idle.reset()
            return 0.0
        armed_wait = wait = self.settings.poll_min_s
        if report.selected:
            self._idle.reset()
        else:
            wait = self._idle.next()
            armed_wait = self._armed_idle.delay(self._idle.count)
            for until in (self.scheduler.wait_s(), self.store.seconds_until_due()):
                if until is not None:
                    wait = max(min(wait, until), 0.0)
                    armed_wait = max(min(armed_wait, until), 0.0)
        if self.wakeup is None or wait <= 0 or self.gate.paused():
            return wait
        armed = self.wakeup.arm()
        if armed is wakeup.Armed.BUSY:
            # A producer holds the wake lock shared between its INSERT and its COMMIT, usually
            # for a millisecond or less: look again soon rather than a whole poll later (under
            # load, that poll was most of the latency). Consecutive refusals back off up to the
            # poll's own wait, so a long-open producer transaction does not make the drain spin.
            return min(wait, self._busy.next())
        self._busy.reset()
        if armed is wakeup.Armed.DUE:
            self._idle.reset()
            return 0.0
        if self.wakeup.trusted:
            return max(wait, armed_wait)
        return wait

    # --- one step ---------------------------------------------------------------------------

    def drain_once(self) -> BatchReport:
        """Forward one whole batch of due rows; the caller must be the leader.

        BEGIN REPEATABLE READ, verify the lock, select, publish, wait for every acknowledgement,
        delete the acknowledged ids, record failures, COMMIT. Batches left in flight by
        drain_step are collected and settled first, in the same transaction. Database errors and
        LeadershipLost propagate: the batch rolled back and nothing was deleted.
        """
        return self._step(depth=0, limit=self.settings.batch_size)

    def drain_step(self) -> BatchReport:
        """One step of the pipelined loop (``pipeline_depth``); the caller must be the leader.

        Like drain_once, except that a pipelined backend's jobs are only submitted: up to
        ``pipeline_depth`` batches await their acknowledgements while the relay selects and
        submits the next ones, and each is collected and settled by a later step's transaction
        (the next step that finds no rows settles them all; any step, those older than
        drain.pipeline.MAX_AGE_S). If the process dies in between, the rows in flight were not
        deleted and go again: duplicates, never a loss.
        """
        return self._step(depth=self.settings.pipeline_depth, limit=self.settings.batch_size)

    def settle_in_flight(self) -> BatchReport:
        """Collect and settle every batch in flight, selecting nothing new."""
        return self._step(depth=0, limit=0)

    def _step(self, *, depth: int, limit: int) -> BatchReport:
        started = time.perf_counter()
        flights, self._flights = self._flights, pipeline.InFlight(clock=self._clock)  # kept if committed
        self.gate.begin_step()
        report = BatchReport()
        decided: settlement.Settlement | None = None
        try:
            with self.store.batch(relaxed=True) as batch:
                self.leadership.verify(batch)
                jobs = batch.select_due(limit, self.gate.paused(), flights.row_ids())
                report.selected, report.full = len(jobs), limit > 0 and len(jobs) >= limit
                if not jobs and not flights:
                    return report
                if jobs:
                    self.failpoints.hit("after_select")
                results, submitted = self.gate.forward(jobs, submit=depth > 0)
                flights.add(submitted)
                # Any step that found rows leaves up to ``depth`` batches awaiting their confirms,
                # partial ones too: waiting for a partial batch's confirms before reading the
                # next rows put the broker's confirm latency into every job's (at 2,000 jobs/s,
                # p50 23 ms instead of 5). A step that finds nothing settles everything.
                collected = flights.due(keep=depth if jobs else 0)
                results.update(self.gate.collect(collected))
                flights.drop(self.gate.failed)
                self.failpoints.hit("after_publish")
                handed_over = {job.id for flight in submitted for job in flight.jobs}
                settled = [job for job in jobs if job.id not in handed_over]
                settled += [job for flight in collected for job in flight.jobs]
                untouched = results.keys() | set(flights.row_ids())
                report.skipped = sum(1 for job in settled if job.id not in untouched)
                decided = self._decide(settled, results)
                self._write(batch, decided)
        except psycopg.errors.SerializationFailure:
            if decided is None:
                raise
            self._write_again(decided)  # an app changed a row we read: the fence decides, not 40001
        self._flights = flights
        self.failpoints.hit("after_commit")
        self._record(decided, report, time.perf_counter() - started)
        return report

    def _decide(self, jobs: list[models.StagedJob], results: gate.Results) -> settlement.Settlement:
        return settlement.decide(
            jobs,
            results,
            max_attempts=lambda name: self._max_attempts.get(name, self.settings.max_attempts),
            retry_backoff=self._retry_backoff,
        )

    def _write(self, batch: store.Batch, decided: settlement.Settlement) -> None:
        batch.delete(decided.delete)
        self.failpoints.hit("after_delete")
        batch.record_failures(decided.retry)
        batch.bury(decided.dead)

    def _write_again(self, decided: settlement.Settlement) -> None:
        """Write a settlement in a fresh fenced transaction, retrying serialization failures:
        a row the app deleted meanwhile is simply gone, one it updated is settled as forwarded."""
        for attempt in range(1, SERIALIZATION_RETRIES + 1):
            try:
                with self.store.batch(relaxed=True) as batch:
                    self.leadership.verify(batch)
                    self._write(batch, decided)
                return
            except psycopg.errors.SerializationFailure:
                if attempt == SERIALIZATION_RETRIES:
                    raise
                log.info(
                    "a staged row changed under the batch (40001); writing the settlement again",
                    extra={
                        "event": "settlement_retry",
                        "attempts": attempt,
                        "reason": "serialization_failure",
                    },
                )
                time.sleep(0.01 * attempt)

    def _record(self, decided: settlement.Settlement | None, report: BatchReport, duration_s: float) -> None:
        self.metrics.set_in_flight(self._flights.jobs)
        if decided is None:
            return
        report.published, report.dead = len(decided.delete), len(decided.dead)
        report.retried, report.rejected = decided.retried, decided.rejected
        for (backend_name, queue, outcome), count in decided.outcomes.items():
            self.metrics.count_jobs(backend_name, queue, outcome, count)
        now = time.monotonic()
        for job in decided.published:
            self.metrics.observe_delay(job.backend, job.age_s + (now - job.read_at))
        for dead in decided.dead:
            self.metrics.count_dead(dead.job.backend, dead.job.queue)
            log.warning(
                "job %s (%s) dead-lettered after %d attempts: %s",
                dead.job.job_id,
                dead.job.job_name,
                dead.attempts,
                dead.error,
                extra={
                    "event": "dead_lettered",
                    "backend": dead.job.backend,
                    "queue": dead.job.queue,
                    "job_ids": [str(dead.job.job_id)],
                    "job_name": dead.job.job_name,
                    "attempts": dead.attempts,
                    "reason": dead.error,
                },
            )
        self.metrics.observe_batch(duration_s, report.selected)
        if log.isEnabledFor(logging.DEBUG):
            self._log_batch(decided, report, duration_s)

    def _log_batch(self, decided: settlement.Settlement, report: BatchReport, duration_s: float) -> None:
        """DEBUG: one line per (backend, queue) the step published to, then the step's totals."""
        groups: dict[tuple[str, str], list[models.StagedJob]] = {}
        for job in decided.published:
            groups.setdefault((job.backend, job.queue), []).append(job)
        for (backend_name, queue), jobs in groups.items():
            log.debug(
                "backend %s: %d jobs published to queue %s",
                backend_name,
                len(jobs),
                queue,
                extra={
                    "event": "published",
                    "backend": backend_name,
                    "queue": queue,
                    "batch_size": len(jobs),
                    "job_ids": logs.job_ids(jobs),
                },
            )
        log.debug(
            "batch of %d: %d published, %d retried, %d rejected, %d dead-lettered, %d skipped in %.3fs",
            report.selected,
            report.published,
            report.retried,
            report.rejected,
            report.dead,
            report.skipped,
            duration_s,
            extra={
                "event": "batch",
                "batch_size": report.selected,
                "published": report.published,
                "retried": report.retried,
                "rejected": report.rejected,
                "dead": report.dead,
                "skipped": report.skipped,
                "in_flight": self._flights.jobs,
                "duration_s": round(duration_s, 6),
            },
        )

    # --- leading, stepping down, figures ----------------------------------------------------

    def _try_lead(self) -> bool:
        if not self.leadership.try_acquire():
            return False
        self.store.require_table()
        self.failpoints.hit("after_lock")
        log.info(
            "leading %s (backend pid %s)",
            self.store.names.qualified,
            self.leadership.pid,
            extra={
                "event": "leading",
                "role": "leader",
                "table": self.store.names.qualified,
                "backend_pid": self.leadership.pid,
            },
        )
        self._standing_by = False
        self.metrics.set_leader(True)
        self._figures_at = float("-inf")
        return True

    def _stand_by(self) -> None:
        if self._standing_by:
            return
        self._standing_by = True
        log.info(
            "standing by: another drain leads %s",
            self.store.names.qualified,
            extra={"event": "standing_by", "role": "standby", "table": self.store.names.qualified},
        )

    def _step_down(self, exc: BaseException) -> None:
        was_leader = self.leadership.is_leader
        in_flight = self._flights.jobs
        self._flights.clear()  # not deleted: the next leader forwards them again
        self.metrics.set_in_flight(0)
        if self.wakeup is not None:
            self.wakeup.forget()
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
        self._standing_by = False  # the next turn that finds another drain leading says so
        self.leadership.forget()
        self.gate.close_all()
        self.store.close()
        if was_leader:
            self.metrics.set_leader(False)

    def refresh_figures(self, *, force: bool = False) -> None:
        """As leader, export the table's gauges; at most every ``figures_refresh_s``, capped counts."""
        now = self._clock()
        if not force and now - self._figures_at < self.figures_refresh_s:
            return
        self._figures_at = now
        figures = self.store.status(metrics.COUNT_CAP)
        figures["read_at"] = time.time()
        self.metrics.set_figures(figures)

    def close_adapters(self) -> None:
        self.gate.close_all()

    def shutdown(self) -> None:
        """Settle the batches in flight, release the lock and close every connection. Idempotent."""
        if self._flights and self.leadership.is_leader:
            in_flight = self.in_flight  # a failed step drops them from the relay's books
            try:
                self.settle_in_flight()
            except Exception as exc:  # noqa: BLE001 - its rows stay staged and go again
                reason = errors.first_line(exc)
                log.warning(
                    "could not settle the last %d jobs in flight; they will be forwarded again: %s",
                    in_flight,
                    reason,
                    extra={"event": "settle_failed", "in_flight": in_flight, "reason": reason},
                )
            self._flights.clear()
            self.metrics.set_in_flight(0)
        if self.leadership.is_leader:
            self.leadership.release()
            self.metrics.set_leader(False)
            log.info(
                "released leadership",
                extra={"event": "released", "role": "standby", "table": self.store.names.qualified},
            )
        if self.wakeup is not None:
            self.wakeup.forget()  # closing the session releases the wake lock
        self.gate.close_all()
        self.store.close()
