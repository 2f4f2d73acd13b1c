"""The relay: the follower/leader loop, and the batch step (drain_once / drain_step), the one
place that orders store and adapter calls.

::

                 ┌──────────── lock taken by another: wait standby_retry_s ± jitter ──┐
                 ▼                                                                     │
    start ──► FOLLOWER ──pg_try_advisory_lock wins──► LEADER ──────────────────────────┘
                 ▲                                      │  drain_step():
                 │ database error / lock lost:          │    BEGIN REPEATABLE READ
                 │ close adapters and session,          │    verify the lock (fence)
                 └─ back off, reconnect ◄───────────────┤    select due rows in id order
                                                        │    publish (or submit) per backend;
                                                        │    collect batches now due
                 stop event ──► finish the batch, settle │    delete exactly the acknowledged ids
                 what is in flight, release, close      │    record failures, bury dead rows
                                                        │    COMMIT
                                                        └─ full batch: again at once;
                                                           else wait (poll backoff / next run_at)

drain_step() is what the loop runs: the same transaction, except that after a full batch a
pipelined backend (RabbitMQ) is only submitted, and its acknowledgements are collected and its
rows settled by a later step's transaction (at most ``pipeline_depth`` batches in flight; rows in
flight are excluded from the select). drain_once() is a step that leaves nothing in flight.

Per-job failures never block the rows behind them: a REJECTED job gets ``attempts + 1``, its error
and a ``run_at`` pushed back exponentially (with jitter), and moves to the dead-letter table after
its backend's ``max_attempts``. A RETRY (a nack) is pushed back briefly without counting an
attempt. A backend that is unavailable is paused with backoff: its rows stay untouched (no
attempt counted, never dead-lettered) and the other backends keep flowing.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import psycopg

from drain import config, errors, failpoints, leadership, metrics, models, schedules, store
from drain.backend import Adapter, PipelinedAdapter

log = logging.getLogger(__name__)

BACKEND_BACKOFF_MIN_S = 0.5
BACKEND_BACKOFF_MAX_S = 30.0
RECONNECT_BACKOFF_MIN_S = 0.5
RECONNECT_BACKOFF_MAX_S = 10.0
RETRY_DELAY_S = 1.0
UNKNOWN_BACKEND = "no backend named {!r} is configured"


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


@dataclasses.dataclass
class _Flight:
    """One backend's share of a batch, submitted and not yet collected."""

    backend: str
    jobs: list[models.StagedJob]
    ticket: object


@dataclasses.dataclass
class _Pause:
    until: float
    delay_s: float


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
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self.adapters = dict(adapters)
        self.store = db or store.Store(settings)
        self.leadership = leadership.Leadership(self.store)
        self.scheduler = schedules.Scheduler(settings, self.store, self.leadership, clock=clock)
        self.metrics = metrics_ or metrics.Metrics()
        self.failpoints = failpoints_ or failpoints.Failpoints()
        self._clock = clock
        self._jitter = jitter
        self._open: set[str] = set()
        self._paused: dict[str, _Pause] = {}
        self._groups: collections.deque[list[_Flight]] = collections.deque()
        self._pipelined = {
            name for name, adapter in self.adapters.items() if isinstance(adapter, PipelinedAdapter)
        }
        self.figures_refresh_s = metrics.REFRESH_S
        self._figures_at = float("-inf")
        self._max_attempts = {name: backend.max_attempts for name, backend in settings.backends.items()}

    # --- one batch ------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Jobs submitted by earlier pipelined steps whose acknowledgements are not settled yet."""
        return sum(len(flight.jobs) for group in self._groups for flight in group)

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

        Like drain_once, except that after a full batch a pipelined backend's jobs are only
        submitted: up to ``pipeline_depth`` batches await their acknowledgements while the relay
        selects and submits the next ones, and each is collected and settled (its acknowledged
        ids deleted) by a later step's transaction. Rows in flight are excluded from the select.
        A partial batch settles everything at once. If the process dies in between, the rows in
        flight were not deleted and are forwarded again: a duplicate, never a loss.
        """
        return self._step(depth=self.settings.pipeline_depth, limit=self.settings.batch_size)

    def settle_in_flight(self) -> BatchReport:
        """Collect and settle every batch in flight, selecting nothing new."""
        return self._step(depth=0, limit=0)

    def _step(self, *, depth: int, limit: int) -> BatchReport:
        report = BatchReport()
        started = time.perf_counter()
        groups, self._groups = self._groups, collections.deque()  # dropped if the step fails
        with self.store.batch() as batch:
            self.leadership.verify(batch)
            exclude = [job.id for group in groups for flight in group for job in flight.jobs]
            jobs = batch.select_due(limit, self._paused_backends(), exclude)
            report.selected = len(jobs)
            report.full = limit > 0 and len(jobs) >= limit
            if not jobs and not groups:
                return report
            if jobs:
                self.failpoints.hit("after_select")
            failed: set[str] = set()  # backends found unavailable (and paused) in this step
            results, flights = self._publish(jobs, report, failed, pipeline=depth > 0)
            # Jobs published (or refused) now settle now; a submitted batch settles when collected.
            submitted = {job.id for flight in flights for job in flight.jobs}
            settled = [job for job in jobs if job.id not in submitted]
            if flights:
                groups.append(flights)
            keep = depth if report.full else 0
            while len(groups) > keep:
                group = groups.popleft()
                results.update(self._collect(group, report, failed))
                settled.extend(job for flight in group for job in flight.jobs)
            # A backend that failed in this step is paused: its later batches are dropped, their
            # rows untouched (not deleted; they go again after the pause).
            groups = collections.deque(
                kept for kept in ([f for f in group if f.backend not in failed] for group in groups) if kept
            )
            self.failpoints.hit("after_publish")
            self._settle(batch, settled, results, report)
        self._groups = groups
        self.metrics.set_in_flight(self.in_flight)
        self.failpoints.hit("after_commit")
        self.metrics.observe_batch(time.perf_counter() - started, len(jobs))
        return report

    def _publish(
        self, jobs: Sequence[models.StagedJob], report: BatchReport, failed: set[str], *, pipeline: bool
    ) -> tuple[dict[int, models.PublishResult], list[_Flight]]:
        """Publish each backend's share now, or submit it (pipelined backends); ``failed``
        gains each backend found unavailable."""
        by_backend: dict[str, list[models.StagedJob]] = collections.defaultdict(list)
        for job in jobs:
            by_backend[job.backend].append(job)
        results: dict[int, models.PublishResult] = {}
        flights: list[_Flight] = []
        for index, (name, group) in enumerate(by_backend.items()):
            if index:
                self.failpoints.hit("mid_publish")
            adapter = self.adapters.get(name)
            if adapter is None:
                message = UNKNOWN_BACKEND.format(name)
                results.update((job.id, models.PublishResult.rejected(job, message)) for job in group)
                continue
            try:
                self._ensure_open(name, adapter)
                if pipeline and name in self._pipelined:
                    flights.append(_Flight(name, group, cast(PipelinedAdapter, adapter).submit(group)))
                    continue
                answered = adapter.publish_batch(group)
            except errors.BackendUnavailable as exc:
                self._fail(name, exc, failed)
                report.skipped += len(group)
                continue
            self._take(name, group, answered, results)
        return results, flights

    def _collect(
        self, flights: Sequence[_Flight], report: BatchReport, failed: set[str]
    ) -> dict[int, models.PublishResult]:
        """Results of submitted batches; ``failed`` gains each backend found unavailable."""
        results: dict[int, models.PublishResult] = {}
        for flight in flights:
            adapter = cast(PipelinedAdapter, self.adapters[flight.backend])
            try:
                answered = adapter.collect(flight.ticket)
            except errors.BackendUnavailable as exc:
                self._fail(flight.backend, exc, failed)
                report.skipped += len(flight.jobs)
                continue
            self._take(flight.backend, flight.jobs, answered, results)
        return results

    def _take(
        self,
        name: str,
        group: Sequence[models.StagedJob],
        answered: Sequence[models.PublishResult],
        results: dict[int, models.PublishResult],
    ) -> None:
        """Keep one result per job of ``group``; a job the adapter did not answer is a RETRY."""
        self._resume(name)
        wanted = {job.id for job in group}
        for result in answered:
            if result.row_id in wanted:
                results[result.row_id] = result
        for job in group:
            if job.id not in results:
                results[job.id] = models.PublishResult.retry(job, f"{name}: no result returned")

    def _settle(
        self,
        batch: store.Batch,
        jobs: Sequence[models.StagedJob],
        results: Mapping[int, models.PublishResult],
        report: BatchReport,
    ) -> None:
        now = datetime.datetime.now(datetime.UTC)
        published: list[int] = []
        failed_ids: list[int] = []
        failed_counted: list[int] = []
        failed_errors: list[str] = []
        failed_delays: list[float] = []
        dead_ids: list[int] = []
        dead_errors: list[str] = []
        outcomes: collections.Counter[tuple[str, str, str]] = collections.Counter()
        for job in jobs:
            result = results.get(job.id)
            if result is None:
                continue
            outcome = result.outcome
            outcomes[job.backend, job.queue, outcome.value] += 1
            if outcome is models.Outcome.PUBLISHED:
                published.append(job.id)
                self.metrics.observe_delay(job.backend, (now - job.created_at).total_seconds())
                continue
            error = (result.error or outcome.value)[:2000]
            if outcome is models.Outcome.RETRY:
                report.retried += 1
                failed_ids.append(job.id)
                failed_counted.append(0)
                failed_errors.append(error)
                failed_delays.append(RETRY_DELAY_S * (0.5 + self._jitter()))
                continue
            report.rejected += 1
            attempts = job.attempts + 1
            if attempts >= self._max_attempts.get(job.backend, self.settings.max_attempts):
                dead_ids.append(job.id)
                dead_errors.append(error)
                self.metrics.count_dead(job.backend, job.queue)
                log.warning(
                    "job %s (%s) dead-lettered after %d attempts: %s",
                    job.job_id,
                    job.job_name,
                    attempts,
                    error,
                )
            else:
                failed_ids.append(job.id)
                failed_counted.append(1)
                failed_errors.append(error)
                failed_delays.append(self._backoff(attempts))
        for (backend_name, queue, outcome_name), count in outcomes.items():
            self.metrics.count_jobs(backend_name, queue, outcome_name, count)
        report.published = len(published)
        report.dead = len(dead_ids)
        batch.delete(published)
        self.failpoints.hit("after_delete")
        batch.record_failures(failed_ids, failed_counted, failed_errors, failed_delays)
        batch.bury(dead_ids, dead_errors)

    def _backoff(self, attempts: int) -> float:
        base: float = self.settings.retry_base_s * 2.0 ** min(attempts - 1, 30)
        return min(base, self.settings.retry_max_s) * (0.5 + self._jitter() / 2)

    # --- backends -------------------------------------------------------------------------

    def _paused_backends(self) -> list[str]:
        now = self._clock()
        return [name for name, pause in self._paused.items() if pause.until > now]

    def _ensure_open(self, name: str, adapter: Adapter) -> None:
        if name not in self._open:
            adapter.open()
            self._open.add(name)

    def _fail(self, name: str, exc: errors.BackendUnavailable, failed: set[str]) -> None:
        """Pause a backend found unavailable, once per step however many of its batches fail."""
        if name not in failed:
            failed.add(name)
            self._pause(name, exc)

    def _pause(self, name: str, exc: errors.BackendUnavailable) -> None:
        previous = self._paused.get(name)
        delay = (
            BACKEND_BACKOFF_MIN_S if previous is None else min(previous.delay_s * 2, BACKEND_BACKOFF_MAX_S)
        )
        self._paused[name] = _Pause(self._clock() + delay * (0.5 + self._jitter()), delay)
        self._close_adapter(name)
        self.metrics.set_backend_up(name, False)
        log.warning("backend %s unavailable, retrying in %.1fs: %s", name, delay, exc)

    def _resume(self, name: str) -> None:
        if self._paused.pop(name, None) is not None:
            log.info("backend %s is available again", name)
        self.metrics.set_backend_up(name, True)

    def _close_adapter(self, name: str) -> None:
        if name in self._open:
            self._open.discard(name)
            try:
                self.adapters[name].close()
            except Exception as exc:  # noqa: BLE001 - closing a broken connection may fail
                log.debug("closing backend %s failed: %s", name, type(exc).__name__)

    def close_adapters(self) -> None:
        for name in list(self._open):
            self._close_adapter(name)

    # --- the loop -------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Follow or lead until ``stop`` is set; then finish the batch, release, close."""
        poll_s = self.settings.poll_min_s
        reconnect_s = RECONNECT_BACKOFF_MIN_S
        try:
            while not stop.is_set():
                self.metrics.tick()
                try:
                    if not self.leadership.is_leader and not self._try_lead():
                        stop.wait(self.settings.standby_retry_s * (0.75 + self._jitter() / 2))
                        continue
                    self.scheduler.stage_due()  # its own fenced transaction, only when a tick may be due
                    report = self.drain_step()
                    self.refresh_figures()
                    reconnect_s = RECONNECT_BACKOFF_MIN_S
                    if report.full or self._groups:
                        poll_s = self.settings.poll_min_s
                        continue
                    poll_s = (
                        self.settings.poll_min_s
                        if report.selected or report.published
                        else min(poll_s * 2, self.settings.poll_max_s)
                    )
                    # After a partial batch the wait is already the shortest: no need to ask
                    # when the next deferred row falls due.
                    stop.wait(self._idle_wait(poll_s) if not report.selected else poll_s)
                except errors.PoolerDetected:
                    raise
                except (psycopg.Error, errors.LeadershipLost, errors.DrainError) as exc:
                    self._step_down(exc)
                    stop.wait(reconnect_s * (0.5 + self._jitter()))
                    reconnect_s = min(reconnect_s * 2, RECONNECT_BACKOFF_MAX_S)
        finally:
            self.shutdown()

    def refresh_figures(self, *, force: bool = False) -> None:
        """As leader, export the table's gauges; at most every ``figures_refresh_s``, capped counts."""
        now = self._clock()
        if not force and now - self._figures_at < self.figures_refresh_s:
            return
        self._figures_at = now
        figures = self.store.status(metrics.COUNT_CAP)
        figures["read_at"] = time.time()
        self.metrics.set_figures(figures)

    def _try_lead(self) -> bool:
        if not self.leadership.try_acquire():
            return False
        self.store.require_table()
        self.failpoints.hit("after_lock")
        log.info("leading %s (backend pid %s)", self.store.names.qualified, self.leadership.pid)
        self.metrics.set_leader(True)
        self._figures_at = float("-inf")
        return True

    def _idle_wait(self, poll_s: float) -> float:
        tick_s = self.scheduler.wait_s()
        if tick_s is not None:
            poll_s = min(poll_s, tick_s)
        next_run_at = self.store.next_run_at()
        if next_run_at is None:
            return poll_s
        until = (next_run_at - datetime.datetime.now(datetime.UTC)).total_seconds()
        return max(min(poll_s, until), 0.0)

    def _step_down(self, exc: BaseException) -> None:
        was_leader = self.leadership.is_leader
        self._groups.clear()  # not deleted: the next leader forwards them again
        self.metrics.set_in_flight(0)
        log.warning("%s: %s", "lost leadership" if was_leader else "database error", errors.first_line(exc))
        self.leadership.forget()
        self.close_adapters()
        self.store.close()
        if was_leader:
            self.metrics.set_leader(False)

    def shutdown(self) -> None:
        """Settle the batch in flight, release the lock and close every connection. Idempotent."""
        if self._groups and self.leadership.is_leader:
            in_flight = self.in_flight  # a failed step drops them from the relay's bookkeeping
            try:
                self.settle_in_flight()
            except Exception as exc:  # noqa: BLE001 - its rows stay staged and go again
                log.warning(
                    "could not settle the last %d jobs in flight; they will be forwarded again: %s",
                    in_flight,
                    errors.first_line(exc),
                )
            self._groups.clear()
            self.metrics.set_in_flight(0)
        if self.leadership.is_leader:
            self.leadership.release()
            self.metrics.set_leader(False)
            log.info("released leadership")
        self.close_adapters()
        self.store.close()
