"""Writing a step's settlement: in the step's own transaction, or again in a fresh one.

The per-job results become a settlement (drain.relay.settlement.decide: delete, retry later,
bury); its three parts are written, the retry UPDATE and the burial each in a savepoint, so that
refused they never undo the DELETE of delivered rows. The rows the table refuses are parked or
held (drain.relay.refusals); a row another transaction holds a lock on is deferred to a later
step rather than waited for.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import psycopg

from drain import models
from drain.config import settings as config
from drain.relay import backoff, blockage, dispatch, failpoints, leadership, refusals, settlement, settling
from drain.store import session as store

log = logging.getLogger(__name__)

SERIALIZATION_RETRIES = 5
SETTLE_LOCK_WAIT_MS = 50  # a settlement's longest wait for a row lock an app holds
RETRY_LOCK_WAIT_MS = 1000  # a retried settlement's longest wait for a lock (a table locked against writes)


@dataclasses.dataclass(frozen=True)
class ToSettle:
    """What a step settles: the jobs with their results; the rows among them an earlier
    transaction published (``unlocked``: this one did not lock them, an app may hold one), those
    to check for another transaction's lock before writing (``suspect``: held last time), and the
    rows in flight or held elsewhere (``busy``: not probed, drain.relay.refusals.table_refuses)."""

    jobs: list[models.StagedJob]
    results: dispatch.Results
    unlocked: list[int]
    suspect: list[int]
    busy: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Settled:
    """A settlement written: what was decided; the jobs deferred to a later step (an app holds
    their row); those the table refused, held for a later try (``held``) or parked (with why)."""

    decided: settlement.Settlement
    deferred: list[models.StagedJob]
    held: list[models.StagedJob] = dataclasses.field(default_factory=list)
    parked: refusals.Parked = dataclasses.field(default_factory=list)

    def refused_ids(self) -> set[int]:
        """The rows the table refused (parked or held): a dead one among them is no dead letter."""
        return {job.id for job in self.held} | {job.id for job, _ in self.parked}


class Settler:
    """Writes settlements for the relay's steps; use from one thread."""

    def __init__(
        self,
        settings: config.Settings,
        db: store.Store,
        leadership_: leadership.Leadership,
        *,
        failpoints_: failpoints.Failpoints,
        blockage_: blockage.Blockage,
        unsettled: settling.Unsettled,
        paused: Callable[[], list[str]],
        jitter: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.store = db
        self.leadership = leadership_
        self.failpoints = failpoints_
        self.blockage = blockage_
        self.unsettled = unsettled
        self.paused = paused
        self._retry_backoff = backoff.Backoff(settings.retry_base_s, settings.retry_max_s, jitter)
        self._max_attempts = {name: section.max_attempts for name, section in settings.backends.items()}

    def settle(self, batch: store.Batch, to_settle: ToSettle, *, careful: bool = False) -> Settled:
        """Write the settlement the results call for; return it, with the jobs deferred to a later
        step (a ``suspect`` row another transaction holds a lock on) and those the table refused.
        An ``unlocked`` row is not checked (that would lock every row of a pipelined batch once
        more); the writes wait for one at most SETTLE_LOCK_WAIT_MS, then fail with 55P03 (the
        step writes it again). ``careful`` (writing it again after an error): deferred
        constraints fire at each statement, and each part is written in a savepoint, row by row
        where the table refuses it (drain.store.session.Batch.delete). A settlement written again
        (rows held from an earlier step) waits for a lock at most RETRY_LOCK_WAIT_MS; while this
        drain cannot settle, never past the moment settle_timeout_s runs out."""
        if to_settle.unlocked:
            batch.limit_lock_wait(self.blockage.lock_wait_ms(SETTLE_LOCK_WAIT_MS))
        elif to_settle.suspect:  # written again: a lock it waited for may still be held
            batch.limit_lock_wait(self.blockage.lock_wait_ms(RETRY_LOCK_WAIT_MS))
        if careful:
            batch.fire_deferred()
        held = batch.held(to_settle.suspect)
        deferred = [job for job in to_settle.jobs if job.id in held]
        jobs = [job for job in to_settle.jobs if job.id not in held]
        decided = self._decide(jobs, to_settle.results)
        refused = self._write(batch, decided, careful=careful)
        if not refused:
            return Settled(decided, deferred)
        return self._refused(batch, to_settle, decided, deferred, refused)

    def write_again(self, to_settle: ToSettle) -> Settled:
        """Write a settlement carefully (``settle``) in a fresh fenced transaction, retrying
        serialization failures: a row the app deleted meanwhile is simply gone, one it updated is
        settled as forwarded."""
        every = [job.id for job in to_settle.jobs]
        fresh = dataclasses.replace(to_settle, unlocked=every, suspect=every)  # none locked here
        for attempt in range(1, SERIALIZATION_RETRIES + 1):
            try:
                with self.store.batch(relaxed=True) as batch:
                    self.leadership.verify(batch)
                    return self.settle(batch, fresh, careful=True)
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

    def _decide(self, jobs: list[models.StagedJob], results: dispatch.Results) -> settlement.Settlement:
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
        to_settle: ToSettle,
        decided: settlement.Settlement,
        deferred: list[models.StagedJob],
        refused: store.Refused,
    ) -> Settled:
        """The table refused the settlement of some rows: tell the table from the rows, then
        park or hold each refused row (drain.relay.refusals)."""
        published = {job.id for job in decided.published}
        dead = {row.job.id: row for row in decided.dead}
        known = self.unsettled.refused_ids()
        later = {job.id for job in deferred}
        decided_jobs = [job for job in to_settle.jobs if job.id in to_settle.results and job.id not in later]
        fresh = [job for job in decided_jobs if job.id not in known]
        if fresh and all(job.id in refused for job in fresh):
            refusals.table_refuses(
                batch,
                refusals.kinds(fresh, published, dead),
                fresh,
                refused,
                exclude=to_settle.busy + [job.id for job in to_settle.jobs],
                batch_size=self.settings.batch_size,
                paused=self.paused,
            )
        held, parked = refusals.park_or_hold(batch, decided_jobs, refused, published, dead)
        return Settled(decided, deferred, held, parked)
