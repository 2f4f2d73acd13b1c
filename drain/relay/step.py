"""One step of the leader, the one place that orders store and adapter calls.

::

    BEGIN REPEATABLE READ; verify the lock
    select due rows in id order (not those in flight or held), within batch_max_bytes
    forward them (drain.relay.dispatch): publish, or submit to a pipelined backend
    collect the batches in flight that are due (drain.relay.pipeline)
    settle: delete / retry / dead-letter (drain.relay.writing), with the settlement held from an
    earlier step
    COMMIT — then keep what is still in flight, count and log (drain.relay.reporting)

An error before anything was published rolls back (a 40001 at the select: look again at once).
After it, the settlement is written again in a fresh fenced transaction; if that fails too, or
the table refuses it, its jobs are kept (drain.relay.settling.Unsettled, their rows excluded from
selection) and the loop only tries to write it, with backoff, publishing nothing new, until
settle_timeout_s ends the process (drain.relay.blockage).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

from drain import errors, models
from drain.config import settings as config
from drain.observability import metrics
from drain.relay import blockage, dispatch, failpoints, leadership, pipeline, reporting, settling, writing
from drain.store import session as store

Pending = tuple[list[models.StagedJob], dict[int, models.PublishResult]]


class Stepper:
    """Runs the leader's steps and keeps their books: the batches in flight (``flights``) and
    the settlements not written yet (``unsettled``). Use from one thread."""

    def __init__(
        self,
        settings: config.Settings,
        db: store.Store,
        leadership_: leadership.Leadership,
        gate: dispatch.BackendGate,
        *,
        metrics_: metrics.Metrics,
        failpoints_: failpoints.Failpoints,
        blockage_: blockage.Blockage,
        clock: Callable[[], float],
        jitter: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.store = db
        self.leadership = leadership_
        self.gate = gate
        self.metrics = metrics_
        self.failpoints = failpoints_
        self.blockage = blockage_
        self.flights = pipeline.InFlight(clock=clock)
        self.unsettled = settling.Unsettled(clock=clock, rand=jitter)
        self.settler = writing.Settler(
            settings,
            db,
            leadership_,
            failpoints_=failpoints_,
            blockage_=blockage_,
            unsettled=self.unsettled,
            paused=gate.paused,
            jitter=jitter,
        )
        self.reporter = reporting.StepReporter(metrics_)
        self._clock = clock

    def step(self, *, depth: int, limit: int) -> reporting.BatchReport:
        """Select up to ``limit`` rows, forward them leaving up to ``depth`` batches in flight,
        settle what is due, in one fenced transaction (the module docstring)."""
        started = time.perf_counter()
        flights, self.flights = self.flights, pipeline.InFlight(clock=self._clock)  # kept if committed
        pending = self.unsettled.pending()  # settled by this step, or kept
        self.gate.begin_step()
        report = reporting.BatchReport()
        to_settle: writing.ToSettle | None = None
        try:
            with self.store.batch(relaxed=True) as batch:
                self.leadership.verify(batch)
                to_settle = self._forward(batch, flights, pending, depth=depth, limit=limit, report=report)
                if to_settle is None:
                    return report
                written = self.settler.settle(batch, to_settle)
        except (psycopg.Error, errors.SettlementRefused) as exc:
            if to_settle is None and not isinstance(exc, psycopg.errors.SerializationFailure):
                raise
            again = self._recover(exc, to_settle, flights, report)
            if again is None:
                return report
            written = again
        assert to_settle is not None
        self.flights = flights
        first_held = self.unsettled.settled(pending[0], written.deferred, written.held, to_settle.results)
        if self.blockage.said is not None and not self.unsettled.crowded():
            self.blockage.settles_again(self.unsettled.jobs)
        self.failpoints.hit("after_commit")
        self.reporter.refused(written.parked, first_held)
        self.reporter.record(
            written.decided,
            report,
            time.perf_counter() - started,
            in_flight=self.flights.jobs,
            unsettled=self.unsettled.jobs,
            not_buried=written.refused_ids(),
        )
        return report

    def _forward(
        self,
        batch: store.Batch,
        flights: pipeline.InFlight,
        pending: Pending,
        *,
        depth: int,
        limit: int,
        report: reporting.BatchReport,
    ) -> writing.ToSettle | None:
        """Select, forward, collect what is due in flight; return what to settle (None: nothing
        selected, in flight or pending)."""
        exclude = flights.row_ids() + self.unsettled.row_ids()
        budget = self.settings.batch_max_bytes - flights.memory_bytes  # in flight counts
        jobs = batch.select_due(limit, self.gate.paused(), exclude, budget)
        report.selected = len(jobs)
        report.full = limit > 0 and (len(jobs) >= limit or batch.held_back)
        if not jobs and not flights and not pending[0]:
            if self.unsettled.failing and not self.unsettled:
                # Nothing left to write: the failed step's rows were all in flight, gone with its
                # session (a new term), so "failing" must end here, or the loop would retry
                # nothing at full speed forever (red team 25).
                self.unsettled.settled((), (), (), {})
            return None
        if jobs:
            self.failpoints.hit("after_select")
        results, submitted = self.gate.forward(jobs, submit=depth > 0)
        flights.add(submitted)
        # Any step that found rows leaves up to ``depth`` batches awaiting their confirms, partial
        # ones too: waiting for a partial batch's confirms before reading the next rows put the
        # broker's confirm latency into every job's (at 2,000 jobs/s, p50 23 ms instead of 5). A
        # step that finds nothing settles everything.
        collected = flights.due(keep=depth if jobs else 0)
        report.collected = sum(len(flight.jobs) for flight in collected)
        results.update(self.gate.collect(collected))
        flights.drop(self.gate.failed)
        self.failpoints.hit("after_publish")
        handed_over = {job.id for flight in submitted for job in flight.jobs}
        settled = [job for job in jobs if job.id not in handed_over]
        settled += [job for flight in collected for job in flight.jobs]
        untouched = results.keys() | set(flights.row_ids())
        report.skipped = sum(1 for job in settled if job.id not in untouched)
        results.update(pending[1])
        earlier = [job.id for flight in collected for job in flight.jobs]
        busy = flights.row_ids() + self.unsettled.row_ids()
        return writing.ToSettle(settled + pending[0], results, earlier, [job.id for job in pending[0]], busy)

    def _recover(
        self,
        exc: psycopg.Error | errors.SettlementRefused,
        to_settle: writing.ToSettle | None,
        flights: pipeline.InFlight,
        report: reporting.BatchReport,
    ) -> writing.Settled | None:
        """The step's transaction failed: return the settlement written again, or None."""
        if to_settle is None:  # the select met a row an app changed: nothing published
            self.flights = flights
            report.again = True
            return None
        if isinstance(exc, errors.SettlementRefused) or not self.store.alive:
            self._failed(to_settle, flights, exc)
            return None
        # An app changed a row we read (40001: the fence decides), holds one an earlier
        # transaction published (55P03), or the table refused part of the settlement (a trigger,
        # a constraint, at its statement or at COMMIT): write it again in a fresh transaction,
        # each row checked first, each part in a savepoint, row by row if refused.
        try:
            return self.settler.write_again(to_settle)
        except (psycopg.Error, errors.SettlementRefused) as again:
            self._failed(to_settle, flights, again)
            return None

    def _failed(
        self,
        to_settle: writing.ToSettle,
        flights: pipeline.InFlight,
        exc: psycopg.Error | errors.SettlementRefused,
    ) -> None:
        """The settlement of jobs already handed to their backends could not be written: keep
        them, their rows excluded from selection, and try only that again, with backoff. A lost
        session steps down (raises); this drain writes them first when it leads again."""
        delay = self.unsettled.failed(to_settle.jobs, to_settle.results)
        self.metrics.count_settlement_failure()
        self.metrics.set_unsettled(self.unsettled.jobs)
        if not self.store.alive:
            raise exc
        self.flights = flights  # still awaiting their confirms: collected by the next attempt
        blocker = settling.settlement_failed(self.unsettled.jobs, exc)
        self.blockage.warn(blocker, delay, "it is", self.unsettled.jobs)

    def settle_again(self) -> float:
        """When a failed settlement's backoff is up, write it (and collect every batch in flight)
        without selecting anything new; return how long to wait next."""
        wait = self.unsettled.wait_s()
        if wait > 0 and not self.blockage.out_of_time():
            return wait
        self.step(depth=0, limit=0)
        self.held_too_many()
        if self.unsettled.failing:
            return self.unsettled.wait_s()
        return 0.0

    def held_too_many(self) -> None:
        """Past the cap of rows held (Unsettled.crowded: the table refuses their settlement, their
        parking and their parking in place), the table refuses most rows' settlement: count it as
        the settlement failing — nothing new is published, the held rows are tried again with
        backoff, and the process ends (CannotSettle, exit 6) once it lasted settle_timeout_s."""
        if not self.unsettled.crowded() or (self.unsettled.failing and not self.unsettled.over_cap):
            return  # a failed write of the settlement backs off and counts on its own
        delay = self.unsettled.crowded_out()
        self.metrics.count_settlement_failure()
        self.metrics.set_unsettled(self.unsettled.jobs)
        blocker = settling.too_many_held(self.unsettled.jobs, self.unsettled.bytes)
        self.blockage.warn(blocker, delay, "they are", self.unsettled.jobs)
