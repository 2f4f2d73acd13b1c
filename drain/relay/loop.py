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

Settle or do not publish (drain.relay.settling): a standby leads only where its session can settle
(not a standby server, not read-only, the privileges, the probe of the table). A step whose
settlement fails keeps its jobs (Unsettled, their rows excluded from selection); the loop then
only tries to write it, with backoff, publishing nothing new, and ends the process
(CannotSettle, exit 6) once it failed for ``settle_timeout_s``. Rows a pipelined batch
published in an earlier transaction that an app holds a lock on are settled by a later step
rather than waited for.

Where each concern lives: which backends are open or paused, and every adapter call with its
failures translated — drain.relay.gate; batches awaiting broker confirms — drain.relay.pipeline; what the
per-job results mean for the rows — drain.relay.settlement (pure); every SQL statement — drain.store.session;
the lock — drain.relay.leadership; growing waits — drain.relay.backoff; a loop that stopped making progress
— drain.relay.watchdog; periodic jobs staged once per tick — drain.relay.schedules (before each step); the
idle leader woken by a producer's commit — drain.relay.wakeup (armed after a step, disarmed before the next).

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

from drain import errors, models
from drain.backend import Adapter
from drain.config import settings as config
from drain.observability import logs, metrics
from drain.relay import (
    backoff,
    failpoints,
    gate,
    leadership,
    pipeline,
    schedules,
    settlement,
    settling,
    wakeup,
)
from drain.relay.watchdog import Watchdog
from drain.store import session as store

log = logging.getLogger(__name__)

RECONNECT_MIN_S = 0.5
BUSY_MIN_S = 0.001  # a producer's transaction is open: its commit is likely a moment away
LOCKED_MAX_S = 0.1
"""The longest the idle leader waits between looks while it cannot arm the wake-up: an app's
transaction locks a due row, or a producer's open transaction holds the wake lock. This is what a
fresh row may wait then (red teams 28 and 29: up to poll_max_s)."""
RECONNECT_MAX_S = 10.0
SERIALIZATION_RETRIES = 5
SETTLE_LOCK_WAIT_MS = 50  # a settlement's longest wait for a row lock an app holds
RETRY_LOCK_WAIT_MS = 1000  # a retried settlement's longest wait for a lock (a table locked against writes)


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
    again: bool = False
    """The select met a row changed since the step's snapshot (40001), before anything was
    published: look again at once."""


_ANOTHER_LEADS = "another_leader"


@dataclasses.dataclass(frozen=True)
class _ToSettle:
    """What a step settles: the jobs with their results; the rows among them an earlier
    transaction published (``unlocked``: this one did not lock them, an app may hold one), those
    to check for another transaction's lock before writing (``suspect``: held last time), and the
    rows in flight or held elsewhere (``busy``: not probed, drain.relay.loop.Relay._refused)."""

    jobs: list[models.StagedJob]
    results: gate.Results
    unlocked: list[int]
    suspect: list[int]
    busy: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Settled:
    """A settlement written: what was decided; the jobs deferred to a later step (an app holds
    their row); those the table refused, held for a later try (``held``) or parked (with why)."""

    decided: settlement.Settlement
    deferred: list[models.StagedJob]
    held: list[models.StagedJob] = dataclasses.field(default_factory=list)
    parked: list[tuple[models.StagedJob, str]] = dataclasses.field(default_factory=list)

    def refused_ids(self) -> set[int]:
        """The rows the table refused (parked or held): a dead one among them is no dead letter."""
        return {job.id for job in self.held} | {job.id for job, _ in self.parked}


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
        self.gate = gate.BackendGate(
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
        self.figures_refresh_s = metrics.REFRESH_S
        self._clock = clock
        self._flights = pipeline.InFlight(clock=clock)
        self._retry_backoff = backoff.Backoff(settings.retry_base_s, settings.retry_max_s, jitter)
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
        self._figures_at = float("-inf")
        self._max_attempts = {name: section.max_attempts for name, section in settings.backends.items()}
        self._unsettled = settling.Unsettled(clock=clock, rand=jitter)
        self._said: str | None = None  # the standby (or cannot-settle) reason last logged
        self._blocked_since: float | None = None  # cannot settle (no failover to wait for) since

    @property
    def in_flight(self) -> int:
        """Jobs submitted by earlier pipelined steps whose acknowledgements are not settled yet."""
        return self._flights.jobs

    @property
    def unsettled(self) -> settling.Unsettled:
        """Jobs handed to their backend whose settlement is not written yet."""
        return self._unsettled

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
        wait = self._turn()
        if self._blocked_since is None:
            return wait
        return max(min(wait, self._blocked_since + self.settings.settle_timeout_s - self._clock()), 0.0)

    def _turn(self) -> float:
        self.metrics.tick()
        if self.watchdog is not None:
            self.watchdog.pet()
        try:
            if self.wakeup is not None:
                self.wakeup.disarm()  # awake: producers stop notifying
            if not self.leadership.is_leader and not self._try_lead():
                self._stand_by()
                return self._standby.delay(1)
            if self._unsettled.failing:
                return self._settle_again()
            self.scheduler.stage_due()  # its own fenced transaction, only when a tick may be due
            report = self.drain_step()
            self._held_too_many()
            if self._unsettled.failing:  # its settlement failed: only that, until it is written
                return self._unsettled.wait_s()
            self.refresh_figures()
            self._reconnects.reset()
            return self._pause_after(report)
        except (errors.PoolerDetected, errors.CannotSettle):
            raise
        except (psycopg.Error, errors.DrainError) as exc:
            self._step_down(exc)
            return self._reconnects.next()

    def _pause_after(self, report: BatchReport) -> float:
        """Full batch or batches in flight: at once (the next step settles what is in flight if
        it finds nothing new). Partial: the shortest poll. Idle: back off, but wake when the
        earliest future row falls due (the database's clock says when).

        With the wake-up on, a partial or empty step arms it (drain.relay.wakeup): a producer's commit
        ends the wait, which is then only the safety net, so an idle one backs off further, to
        wakeup_poll_max_s, while no notification was missed. When a producer's open transaction
        refuses the arming, the leader looks again after BUSY_MIN_S, backing off. Not while a
        backend is paused: its rows are due but not selectable, so "anything due?" would always
        say yes; nor while rows are held out of selection (Unsettled) for the same reason:
        the leader then polls, and wakes when a held row's next try is due."""
        if report.full or report.again or self._flights:
            self._idle.reset()
            return 0.0
        armed_wait = wait = self.settings.poll_min_s
        if report.selected:
            self._idle.reset()
            self._locked.reset()
        else:
            wait = self._idle.next()
            armed_wait = self._armed_idle.delay(self._idle.count)
            for until in (
                self.scheduler.wait_s(),
                self.store.seconds_until_due(),
                self._unsettled.next_try_s(),
            ):
                if until is not None:
                    wait = max(min(wait, until), 0.0)
                    armed_wait = max(min(armed_wait, until), 0.0)
        if self.wakeup is None or wait <= 0 or self.gate.paused() or self._unsettled:
            return wait
        self.failpoints.hit("before_arm")
        armed = self.wakeup.arm()
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
        due_s = self.wakeup.next_due_s  # a row committed since seconds_until_due notified nobody
        if due_s is not None:
            wait, armed_wait = max(min(wait, due_s), 0.0), max(min(armed_wait, due_s), 0.0)
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
        drain.relay.pipeline.MAX_AGE_S). If the process dies in between, the rows in flight were not
        deleted and go again: duplicates, never a loss.
        """
        return self._step(depth=self.settings.pipeline_depth, limit=self.settings.batch_size)

    def settle_in_flight(self) -> BatchReport:
        """Collect and settle every batch in flight, selecting nothing new."""
        return self._step(depth=0, limit=0)

    def _step(self, *, depth: int, limit: int) -> BatchReport:
        started = time.perf_counter()
        flights, self._flights = self._flights, pipeline.InFlight(clock=self._clock)  # kept if committed
        pending, pending_results = self._unsettled.pending()  # settled by this step, or kept
        self.gate.begin_step()
        report = BatchReport()
        to_settle: _ToSettle | None = None
        written: _Settled | None = None
        try:
            with self.store.batch(relaxed=True) as batch:
                self.leadership.verify(batch)
                exclude = flights.row_ids() + self._unsettled.row_ids()
                budget = self.settings.batch_max_bytes - flights.memory_bytes  # in flight counts
                jobs = batch.select_due(limit, self.gate.paused(), exclude, budget)
                report.selected = len(jobs)
                report.full = limit > 0 and (len(jobs) >= limit or batch.held_back)
                if not jobs and not flights and not pending:
                    if self._unsettled.failing and not self._unsettled:
                        # Nothing left to write: the failed step's rows were all in flight, gone
                        # with its session (a new term), so "failing" must end here, or the loop
                        # would retry nothing at full speed forever (red team 25).
                        self._unsettled.settled((), (), (), {})
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
                results.update(pending_results)
                earlier = [job.id for flight in collected for job in flight.jobs]
                busy = flights.row_ids() + self._unsettled.row_ids()
                to_settle = _ToSettle(settled + pending, results, earlier, [job.id for job in pending], busy)
                written = self._settle(batch, to_settle)
        except (psycopg.Error, errors.SettlementRefused) as exc:
            if to_settle is None:
                if not isinstance(exc, psycopg.errors.SerializationFailure):
                    raise
                self._flights = flights  # the select met a row an app changed: nothing published
                report.again = True
                return report
            if isinstance(exc, errors.SettlementRefused) or not self.store.alive:
                self._settlement_failed(to_settle, flights, exc)
                return report
            # An app changed a row we read (40001: the fence decides), holds one an earlier
            # transaction published (55P03), or the table refused part of the settlement (a
            # trigger, a constraint, at its statement or at COMMIT): write it again in a fresh
            # transaction, each row checked first, each part in a savepoint, row by row if refused.
            try:
                written = self._write_again(to_settle)
            except (psycopg.Error, errors.SettlementRefused) as again:
                self._settlement_failed(to_settle, flights, again)
                return report
        assert written is not None and to_settle is not None
        self._flights = flights
        first_held = self._unsettled.settled(pending, written.deferred, written.held, to_settle.results)
        if self._said is not None and not self._unsettled.crowded():
            self._settles_again()
        self.failpoints.hit("after_commit")
        self._report_refused(written, first_held)
        self._record(written.decided, report, time.perf_counter() - started, written.refused_ids())
        return report

    def _settle(self, batch: store.Batch, to_settle: _ToSettle, *, careful: bool = False) -> _Settled:
        """Write the settlement the results call for; return it, with the jobs deferred to a later
        step (a ``suspect`` row another transaction holds a lock on) and those the table refused.
        An ``unlocked`` row is not checked (that would lock every row of a pipelined batch once
        more); the writes wait for one at most SETTLE_LOCK_WAIT_MS, then fail with 55P03 (the
        step writes it again). ``careful`` (writing it again after an error): deferred
        constraints fire at each statement, and each part is written in a savepoint, row by row
        where the table refuses it (drain.store.session.Batch.delete). A settlement written again (rows
        held from an earlier step) waits for a lock at most RETRY_LOCK_WAIT_MS; while this drain
        cannot settle, never past the moment settle_timeout_s runs out."""
        if to_settle.unlocked:
            batch.limit_lock_wait(self._lock_wait_ms(SETTLE_LOCK_WAIT_MS))
        elif to_settle.suspect:  # written again: a lock it waited for may still be held
            batch.limit_lock_wait(self._lock_wait_ms(RETRY_LOCK_WAIT_MS))
        if careful:
            batch.fire_deferred()
        held = batch.held(to_settle.suspect)
        deferred = [job for job in to_settle.jobs if job.id in held]
        jobs = [job for job in to_settle.jobs if job.id not in held]
        decided = self._decide(jobs, to_settle.results)
        refused = self._write(batch, decided, careful=careful)
        if not refused:
            return _Settled(decided, deferred)
        return self._refused(batch, to_settle, decided, deferred, refused)

    def _lock_wait_ms(self, most_ms: int) -> int:
        """A settlement's longest lock wait: ``most_ms``, and while this drain cannot settle no
        longer than the time settle_timeout_s leaves (at least 1 ms), so a write that waits for
        a lock on the table never carries the exit past it."""
        if self._blocked_since is None:
            return most_ms
        left_s = self._blocked_since + self.settings.settle_timeout_s - self._clock()
        return max(min(most_ms, int(left_s * 1000)), 1)

    def _decide(self, jobs: list[models.StagedJob], results: gate.Results) -> settlement.Settlement:
        return settlement.decide(
            jobs,
            results,
            max_attempts=lambda name: self._max_attempts.get(name, self.settings.max_attempts),
            retry_backoff=self._retry_backoff,
        )

    def _write(self, batch: store.Batch, decided: settlement.Settlement, *, careful: bool) -> store.Refused:
        """Write the three parts of a settlement; return the rows the table refused, with why. The
        retry UPDATE and the burial each run in a savepoint: refused, they never undo the DELETE
        of delivered rows."""
        refused = batch.delete(decided.published, careful=careful)
        self.failpoints.hit("after_delete")
        refused |= batch.record_failures(decided.retry)
        refused |= batch.bury(decided.dead)
        return refused

    def _refused(
        self,
        batch: store.Batch,
        to_settle: _ToSettle,
        decided: settlement.Settlement,
        deferred: list[models.StagedJob],
        refused: store.Refused,
    ) -> _Settled:
        """The table refused the settlement of some rows (G6: no row blocks the rest).

        If it refused every row not already known to be refused, it may be the table rather than
        those rows: the same kinds of write are tried on a row of the drain's own
        (drain.store.session.Batch.test_table), or, when it cannot write one, on the other due rows, each
        alone until one takes it (rolled back). If the table refuses them too, or there is no
        other row to tell, the whole settlement fails (SettlementRefused: nothing written, nothing
        new published, drain.relay.settling). Otherwise each refused row is its own matter, however
        many: a published one (the table refused its DELETE) or a dead one (its burial) is parked
        (drain.store.session.Batch.park), never selected again, or, when the table refuses that too (an
        app's CHECK on run_at), parked in place (Batch.park_in_place: only last_error, which
        every select skips); one refused by an error that may pass (a lock wait, a serialization
        failure), whose parking in place is refused too, or whose backoff UPDATE was refused, is
        held by this process (Unsettled, without its content, capped), out of selection, and its
        settlement tried again with a backoff of its own.
        """
        published = {job.id for job in decided.published}
        dead = {row.job.id: row for row in decided.dead}
        known = self._unsettled.refused_ids()
        later = {job.id for job in deferred}
        decided_jobs = [job for job in to_settle.jobs if job.id in to_settle.results and job.id not in later]
        fresh = [job for job in decided_jobs if job.id not in known]
        if fresh and all(job.id in refused for job in fresh):
            kinds = {
                store.DELETE if j.id in published else store.BURY if j.id in dead else store.RETRY
                for j in fresh
            }
            self._table_refuses(
                batch, to_settle, [k for k in store.PROBE_KINDS if k in kinds], fresh, refused
            )
        held: list[models.StagedJob] = []
        parked: list[tuple[models.StagedJob, str]] = []
        for job in decided_jobs:
            if job.id not in refused:
                continue
            why, passing = refused[job.id]
            if job.id in published:
                note = f"published to backend {job.backend}, but the table refused its DELETE: {why}"
            elif job.id in dead:
                row = dead[job.id]
                note = (
                    f"dead after {row.attempts} attempts ({row.error}); the table refused its burial: {why}"
                )
            else:
                held.append(job)  # its backoff was refused: tried again, it was not delivered
                continue
            if passing:
                held.append(job)  # a lock wait, a serialization failure: written again, not parked
                continue
            if batch.park(job, f"{store.PARKED_PREFIX} {note}"):
                parked.append((job, f"{store.PARKED_PREFIX} {note}"))
                continue
            note = (
                f"{store.PARKED_IN_PLACE_PREFIX} {note}; the table refused its parking (run_at "
                f"{store.PARKED_AT.date()}) too, so its run_at stays"
            )
            if batch.park_in_place(job, note):
                parked.append((job, note))
            else:
                held.append(job)
        return _Settled(decided, deferred, held, parked)

    def _table_refuses(
        self,
        batch: store.Batch,
        to_settle: _ToSettle,
        kinds: list[str],
        fresh: list[models.StagedJob],
        refused: store.Refused,
    ) -> None:
        """Every fresh row of a settlement was refused: raise SettlementRefused if the table
        refuses these ``kinds`` of write whichever row they name (a row of the drain's own; the
        other due rows when it cannot write one)."""
        test = batch.test_table(kinds)
        if test.failure is not None:
            raise errors.SettlementRefused(settling.refused_by_table(len(fresh), *test.failure))
        if test.tested:
            return
        exclude = to_settle.busy + [job.id for job in to_settle.jobs]
        probed, failure = batch.probe_due(self.settings.batch_size, self.gate.paused(), exclude, kinds)
        if not probed:
            raise errors.SettlementRefused(
                f"the table refused the settlement of all {len(fresh)} rows (no row of its own, nor "
                f"another due row, to tell whether it refuses every row): {refused[fresh[0].id].why}"
            )
        if failure is not None:
            raise errors.SettlementRefused(settling.refused_by_table(len(fresh), *failure))

    def _report_refused(self, settled: _Settled, first_held: list[models.StagedJob]) -> None:
        """Log each row parked, and each held for the first time; count them."""
        if not settled.parked and not first_held:
            return
        self.metrics.count_settlement_failure()
        self.metrics.count_parked(len(settled.parked))
        for job, note in settled.parked:
            log.warning(
                "job %s (%s) parked: %s",
                job.job_id,
                job.job_name,
                note,
                extra={
                    "event": "settlement_refused",
                    "action": "parked",
                    "backend": job.backend,
                    "queue": job.queue,
                    "job_ids": [str(job.job_id)],
                    "reason": note,
                },
            )
        for job in first_held:
            log.warning(
                "job %s (%s): the table refused its settlement, or its parking and its parking in "
                "place; held out of selection, tried again with backoff",
                job.job_id,
                job.job_name,
                extra={
                    "event": "settlement_refused",
                    "action": "held",
                    "backend": job.backend,
                    "queue": job.queue,
                    "job_ids": [str(job.job_id)],
                },
            )

    def _write_again(self, to_settle: _ToSettle) -> _Settled:
        """Write a settlement carefully (``_settle``) in a fresh fenced transaction, retrying
        serialization failures: a row the app deleted meanwhile is simply gone, one it updated is
        settled as forwarded."""
        every = [job.id for job in to_settle.jobs]
        fresh = dataclasses.replace(to_settle, unlocked=every, suspect=every)  # none locked here
        for attempt in range(1, SERIALIZATION_RETRIES + 1):
            try:
                with self.store.batch(relaxed=True) as batch:
                    self.leadership.verify(batch)
                    return self._settle(batch, fresh, careful=True)
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
        raise AssertionError("unreachable: the last attempt raises")

    def _settlement_failed(
        self,
        to_settle: _ToSettle,
        flights: pipeline.InFlight,
        exc: psycopg.Error | errors.SettlementRefused,
    ) -> None:
        """The settlement of jobs already handed to their backends could not be written: keep
        them, their rows excluded from selection, and try only that again, with backoff. A lost
        session steps down (raises); this drain writes them first when it leads again."""
        delay = self._unsettled.failed(to_settle.jobs, to_settle.results)
        self.metrics.count_settlement_failure()
        self.metrics.set_unsettled(self._unsettled.jobs)
        if not self.store.alive:
            raise exc
        self._flights = flights  # still awaiting their confirms: collected by the next attempt
        self._warn_cannot_settle(settling.settlement_failed(self._unsettled.jobs, exc), delay, "it is")

    def _settle_again(self) -> float:
        """A settlement failed: when its backoff is up, write it (and collect every batch in
        flight) without selecting anything new; return how long to wait next."""
        wait = self._unsettled.wait_s()
        if wait > 0 and not self._out_of_time():
            return wait
        self.settle_in_flight()
        self._held_too_many()
        if self._unsettled.failing:
            return self._unsettled.wait_s()
        self._reconnects.reset()
        return 0.0

    def _held_too_many(self) -> None:
        """Past the cap of rows held (Unsettled.crowded: the table refuses their settlement, their
        parking and their parking in place), the table refuses most rows' settlement: count it as
        the settlement failing — nothing new is published, the held rows are tried again with
        backoff, and the process ends (CannotSettle, exit 6) once it lasted settle_timeout_s."""
        if not self._unsettled.crowded() or (self._unsettled.failing and not self._unsettled.over_cap):
            return  # a failed write of the settlement backs off and counts on its own
        delay = self._unsettled.crowded_out()
        self.metrics.count_settlement_failure()
        self.metrics.set_unsettled(self._unsettled.jobs)
        blocker = settling.too_many_held(self._unsettled.jobs, self._unsettled.bytes)
        self._warn_cannot_settle(blocker, delay, "they are")

    def _warn_cannot_settle(self, blocker: settling.Blocker, delay: float, what: str) -> None:
        """Say once per reason that this leader cannot settle (``what`` is written again in
        ``delay`` seconds), then export it and end the process on time (_cannot_settle)."""
        if self._said != blocker.reason:
            log.warning(
                "cannot settle: %s; publishing nothing new until %s written (again in %.1fs; exit after %gs)",
                blocker.detail,
                what,
                delay,
                self.settings.settle_timeout_s,
                extra={
                    "event": "cannot_settle",
                    "role": "leader",
                    "reason": blocker.reason,
                    "detail": blocker.detail,
                    "unsettled": self._unsettled.jobs,
                    "retry_in_s": round(delay, 3),
                },
            )
        self._cannot_settle(blocker)

    def _out_of_time(self) -> bool:
        """Whether this drain has been unable to settle for settle_timeout_s."""
        since = self._blocked_since
        return since is not None and self._clock() - since >= self.settings.settle_timeout_s

    def _cannot_settle(self, blocker: settling.Blocker) -> None:
        """Export the reason, and end the process (CannotSettle) once it lasted settle_timeout_s;
        a standby server (waiting for a failover) and an older schema (waiting for `drain
        migrate`) have no bound."""
        if self._said != blocker.reason:
            self._said = blocker.reason
            self.metrics.set_cannot_settle(blocker.reason)
        if blocker.unbounded:
            self._blocked_since = None
            return
        now = self._clock()
        if self._blocked_since is None:
            self._blocked_since = now
        elif now - self._blocked_since >= self.settings.settle_timeout_s:
            raise errors.CannotSettle(
                f"cannot settle for {now - self._blocked_since:.0f}s (settle_timeout_s): {blocker.detail}"
            )

    def _settles_again(self) -> None:
        """A step committed after this drain could not settle: say so once, clear the reason."""
        if self._said not in (None, _ANOTHER_LEADS):
            log.info(
                "settling again: published jobs are deleted",
                extra={"event": "settling_again", "role": "leader", "reason": self._said},
            )
        self._said = None
        self._blocked_since = None
        self.metrics.set_cannot_settle(None)
        self.metrics.set_unsettled(self._unsettled.jobs)

    def _record(
        self,
        decided: settlement.Settlement,
        report: BatchReport,
        duration_s: float,
        not_buried: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        """Count and log what a step settled; a dead row in ``not_buried`` (its burial was
        refused: parked or held) is no dead letter."""
        self.metrics.set_in_flight(self._flights.jobs)
        self.metrics.set_unsettled(self._unsettled.jobs)
        buried = [dead for dead in decided.dead if dead.job.id not in not_buried]
        report.published, report.dead = len(decided.published), len(buried)
        report.retried, report.rejected = decided.retried, decided.rejected
        for (backend_name, queue, outcome), count in decided.outcomes.items():
            self.metrics.count_jobs(backend_name, queue, outcome, count)
        now = time.monotonic()
        for job in decided.published:
            self.metrics.observe_delay(job.backend, job.age_s + (now - job.read_at))
        for dead in buried:
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
        self.metrics.set_leader(True)
        self._figures_at = float("-inf")
        if self.leadership.row_security is not None:
            log.warning(
                "warning: %s",
                self.leadership.row_security,
                extra={"event": "row_security", "role": "leader", "table": self.store.names.qualified},
            )
        return True

    def _stand_by(self) -> None:
        """Say why this drain stands by, once per change of reason."""
        blocker = self.leadership.blocker
        if blocker is None:
            self._blocked_since = None
            if self._said == _ANOTHER_LEADS:
                return
            if self._said is not None:
                self.metrics.set_cannot_settle(None)
            self._said = _ANOTHER_LEADS
            log.info(
                "standing by: another drain leads %s",
                self.store.names.qualified,
                extra={"event": "standing_by", "role": "standby", "table": self.store.names.qualified},
            )
            return
        if self._said != blocker.reason:
            log.warning(
                "standing by: %s",
                blocker.detail,
                extra={
                    "event": "standing_by",
                    "role": "standby",
                    "table": self.store.names.qualified,
                    "reason": blocker.reason,
                    "detail": blocker.detail,
                },
            )
        self._cannot_settle(blocker)

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
        self._said = None  # the next turn that finds another drain leading (or a reason) says so
        self._blocked_since = None
        self.metrics.set_cannot_settle(None)
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

    def shutdown(self) -> None:
        """Settle the batches in flight, release the lock and close every connection. Idempotent."""
        if (self._flights or self._unsettled) and self.leadership.is_leader:
            in_flight = self.in_flight + self._unsettled.jobs  # a failed step drops them from the books
            reason = "the settlement failed"
            failed = False
            try:
                self.settle_in_flight()
            except Exception as exc:  # noqa: BLE001 - its rows stay staged and go again
                reason, failed = errors.first_line(exc), True
            if failed or self._flights or self._unsettled:
                log.warning(
                    "could not settle the last %d jobs handed over; they will be forwarded again: %s",
                    in_flight,
                    reason,
                    extra={"event": "settle_failed", "in_flight": in_flight, "reason": reason},
                )
            self._flights.clear()
            self._unsettled.clear()
            self.metrics.set_in_flight(0)
            self.metrics.set_unsettled(0)
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
