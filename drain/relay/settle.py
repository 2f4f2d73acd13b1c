"""Settling: what the per-job results mean for the rows, writing it, and what stands in its way.

The Settler's entry point is ``settle``; ``recover`` handles its failure. It owns:

- deciding: ``decide``, a pure function;
- writing: in the step's transaction, or again in a fresh one;
- the rows the table refuses (parked or held), and the rows this process holds (``Held``);
- why this drain cannot settle, said once per reason, and for how long.

What a result means::

    PUBLISHED            -> delete the row
    RETRY    (a nack)    -> run_at pushed back briefly, or by the result's retry_after_s; no attempt
    REJECTED             -> attempts + 1, last_error, run_at pushed back exponentially (jittered);
                            at the backend's max_attempts: buried (the dead-letter table)

A job without a result is left alone: its backend was unavailable, or it is still in flight.
Every write names its row by id *and* job_id: an id reused since the read is another job.

Writing:
    The DELETE comes first. The retry UPDATE and the burial each run in a savepoint: a refusal
    never undoes the DELETE of delivered rows. A row another transaction locks waits for a
    later step.

When the table refuses a row (G6: no row blocks the rest):
    - Every fresh row refused: the table itself may refuse. The same kinds of write are tried
      on a row of the drain's own (drain.store.session.Batch.test_table), else on other due
      rows. Refused too: the whole settlement fails (SettlementRefused).
    - Otherwise a published or dead row refused for good is parked: never selected again.
    - Its parking refused too (an app's CHECK on run_at): parked in place. Only last_error is
      written, and every select skips it.
    - Any other refused row is held: kept without its content, tried again with its own backoff.

When the whole settlement fails:
    Its jobs are held and ``failing`` is set. The relay forwards nothing new. It retries that
    settlement with backoff until settle_timeout_s ends the process (exit 6). Holding too many
    rows (MAX_HELD_ROWS, MAX_HELD_BYTES) counts the same.

Cannot settle::

    (none) ──a blocker (standing by, a settlement failing)──► said, exported (drain_cannot_settle)
      ▲                                                         │ bounded reason: timed
      │ a step commits, or leadership lost                      ▼
      └──────────────────────────────────────────── settle_timeout_s lasted: CannotSettle (exit 6)

    A standby server and an older schema have no bound (drain.relay.leadership.Blocker.unbounded).
    While the clock runs, no wait of the loop and no lock wait lasts past its end: the process
    ends on time, not a backoff later.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import psycopg

from drain import errors, models
from drain.config import settings as config
from drain.observability import metrics
from drain.relay import backoff, failpoints, forward, leadership
from drain.store import connection, writes
from drain.store import session as store

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 2000
NACK_DELAY_S = 1.0
SERIALIZATION_RETRIES = 5
SETTLE_LOCK_WAIT_MS = 50  # a settlement's longest wait for a row lock an app holds
RETRY_LOCK_WAIT_MS = 1000  # a retried settlement's longest wait for a lock (a table locked against writes)
RETRY_MIN_S = 0.5
RETRY_MAX_S = connection.SETTLEMENT_RETRY_MAX_S
REFUSED_MAX_S = 60.0  # the longest wait between two tries of a held row's settlement
MAX_HELD_ROWS = 10_000
MAX_HELD_BYTES = 8 << 20
"""The most the process holds. Past either, the table refuses most rows' settlement: it counts as
the settlement failing. 8 MiB is within the slack of the memory bound's base (64 MiB, measured
42-56 MB idle): the held rows never take the drain past base + 3 x batch_max_bytes."""
HELD_ROW_BYTES = 1024
"""What one held row takes beyond its names' and its error's text (the job without its content,
its result, their entries): measured about 900 bytes (tests/unit/test_settlement.py)."""
ANOTHER_LEADS = "another_leader"
"""What was said when another drain leads: no reason to export."""
_EMPTY: Mapping[str, Any] = types.MappingProxyType({})

Parked = list[tuple[models.StagedJob, str]]


# --- deciding (pure) -------------------------------------------------------------------------


@dataclasses.dataclass
class Settlement:
    """The SQL actions one batch's results call for, what to count, and what was not written."""

    published: list[models.StagedJob] = dataclasses.field(default_factory=list)
    """The rows to delete: their jobs were published."""
    retry: list[writes.Retry] = dataclasses.field(default_factory=list)
    dead: list[writes.Dead] = dataclasses.field(default_factory=list)
    outcomes: collections.Counter[tuple[str, str, str]] = dataclasses.field(
        default_factory=collections.Counter
    )
    """(backend, queue, outcome) -> jobs."""
    locked: list[models.StagedJob] = dataclasses.field(default_factory=list)
    """Jobs left to a later step: another transaction locks their row (Settler.settle)."""
    held: list[models.StagedJob] = dataclasses.field(default_factory=list)
    """Jobs whose settlement the table refused, kept to try again."""
    parked: Parked = dataclasses.field(default_factory=list)
    """Jobs the table refused, parked, with why."""

    def refused_ids(self) -> set[int]:
        """The rows the table refused (parked or held): a dead one among them is no dead letter."""
        return {job.id for job in self.held} | {job.id for job, _ in self.parked}

    @property
    def rejected(self) -> int:
        return sum(1 for retry in self.retry if retry.counted) + len(self.dead)

    @property
    def retried(self) -> int:
        return sum(1 for retry in self.retry if not retry.counted)


def decide(
    jobs: Iterable[models.StagedJob],
    results: Mapping[int, models.PublishResult],
    *,
    max_attempts: Callable[[str], int],
    retry_backoff: backoff.Backoff,
    nack_backoff: backoff.Backoff | None = None,
) -> Settlement:
    """The settlement of ``jobs`` given their ``results`` (by row id); jobs without one are skipped.

    ``max_attempts(backend)`` is that backend's limit. ``retry_backoff`` spaces a rejected job's
    attempts, ``nack_backoff`` (default: about NACK_DELAY_S) a nacked one's.
    """
    nack = nack_backoff or backoff.Backoff(NACK_DELAY_S * 2, NACK_DELAY_S * 2, retry_backoff.rand)
    settlement = Settlement()
    for job in jobs:
        result = results.get(job.id)
        if result is None:
            continue
        outcome = result.outcome
        settlement.outcomes[job.backend, job.queue, outcome.value] += 1
        if outcome is models.Outcome.PUBLISHED:
            settlement.published.append(job)
            continue
        error = writes.storable((result.error or outcome.value)[:MAX_ERROR_CHARS])
        if outcome is models.Outcome.RETRY:
            delay = nack.delay(1) if result.retry_after_s is None else result.retry_after_s
            settlement.retry.append(
                writes.Retry(row_id=job.id, job_id=job.job_id, counted=0, error=error, delay_s=delay)
            )
            continue
        attempts = job.attempts + 1
        if attempts >= max_attempts(job.backend):
            settlement.dead.append(writes.Dead(job=job, error=error, attempts=attempts))
        else:
            delay = retry_backoff.delay(attempts)
            settlement.retry.append(
                writes.Retry(row_id=job.id, job_id=job.job_id, counted=1, error=error, delay_s=delay)
            )
    return settlement


# --- what a step settles --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToSettle:
    """What a step settles.

    - ``jobs``, with their ``results``;
    - ``unlocked``: the rows an earlier transaction published (flights collected). This one did
      not lock them: an app may hold one;
    - ``suspect``: the rows to check for another transaction's lock before writing (held);
    - ``busy``: the rows in flight or held elsewhere. A probe leaves them alone.
    """

    jobs: list[models.StagedJob]
    results: forward.Results
    unlocked: list[int]
    suspect: list[int]
    busy: list[int] = dataclasses.field(default_factory=list)


# --- the Settler -----------------------------------------------------------------------------


class Settler:
    """Decides and writes the relay's settlements, holds what it could not write yet, and says
    why this drain cannot settle (``said``) and since when (``since``); use from one thread."""

    def __init__(
        self,
        settings: config.Settings,
        db: store.Store,
        leadership_: leadership.Leadership,
        *,
        metrics_: metrics.Metrics,
        failpoints_: failpoints.Failpoints,
        paused: Callable[[], list[str]],
        clock: Callable[[], float],
        jitter: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.store = db
        self.leadership = leadership_
        self.metrics = metrics_
        self.failpoints = failpoints_
        self.paused = paused
        self.held = Held(clock=clock, rand=jitter)
        self.said: str | None = None
        """The reason last said: a Blocker's, ANOTHER_LEADS, or None."""
        self.since: float | None = None
        """Since when this drain cannot settle, while a bounded reason lasts."""
        self._clock = clock
        self._retry_backoff = backoff.Backoff(settings.retry_base_s, settings.retry_max_s, jitter)
        self._max_attempts = {name: section.max_attempts for name, section in settings.backends.items()}

    # --- a step's settlement ------------------------------------------------------------------

    def settle(self, batch: store.Batch, to_settle: ToSettle, *, careful: bool = False) -> Settlement:
        """Write the settlement the results call for; return it, with what could not be written.

        Lock waits:
            - An ``unlocked`` row is not checked: that would lock every row of a pipelined batch
              once more. The writes wait for it at most SETTLE_LOCK_WAIT_MS, then fail with 55P03.
              The step then writes it again.
            - A settlement written again (``suspect`` rows) waits at most RETRY_LOCK_WAIT_MS.
            - While this drain cannot settle, no wait passes the moment settle_timeout_s runs out.

        Careful:
            Writing it again after an error: deferred constraints fire at each statement. Each
            part is written in a savepoint, row by row where the table refuses it
            (drain.store.session.Batch.delete).
        """
        if to_settle.unlocked:
            batch.limit_lock_wait(self._lock_wait_ms(SETTLE_LOCK_WAIT_MS))
        elif to_settle.suspect:  # written again: a lock it waited for may still be held
            batch.limit_lock_wait(self._lock_wait_ms(RETRY_LOCK_WAIT_MS))
        if careful:
            batch.fire_deferred()
        locked_ids = batch.locked(to_settle.suspect)
        jobs = [job for job in to_settle.jobs if job.id not in locked_ids]
        decided = decide(
            jobs,
            to_settle.results,
            max_attempts=lambda name: self._max_attempts.get(name, self.settings.max_attempts),
            retry_backoff=self._retry_backoff,
        )
        decided.locked = [job for job in to_settle.jobs if job.id in locked_ids]
        refused = self._write(batch, decided, careful=careful)
        if refused:
            self._refused(batch, to_settle, decided, refused)
        return decided

    def recover(
        self, exc: psycopg.Error | errors.SettlementRefused, to_settle: ToSettle
    ) -> Settlement | None:
        """The step's transaction failed after its jobs were handed over: return the settlement
        written again in a fresh transaction, or None (held, ``failing``).

        Why it fails: an app changed a row we read (40001: the fence decides), or holds one an
        earlier transaction published (55P03), or the table refused part of the settlement (a
        trigger, a constraint, at its statement or at COMMIT). A lost session raises.
        """
        if isinstance(exc, errors.SettlementRefused) or not self.store.alive:
            self._failed(to_settle, exc)
            return None
        try:
            return self.write_again(to_settle)
        except (psycopg.Error, errors.SettlementRefused) as again:
            self._failed(to_settle, again)
            return None

    def write_again(self, to_settle: ToSettle) -> Settlement:
        """Write a settlement carefully (``settle``) in a fresh fenced transaction.

        Serialization failures are retried: a row the app deleted meanwhile is simply gone, one
        it updated is settled as forwarded.
        """
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

    def committed(
        self, taken: list[models.StagedJob], written: Settlement, results: Mapping[int, models.PublishResult]
    ) -> None:
        """A step committed ``written``: forget the held jobs it wrote (``taken``), hold the rows
        it could not write, and say which rows were parked or held for the first time."""
        first_held = self.held.settled(taken, written.locked, written.held, results)
        if self.said is not None and not self.held.crowded():
            self._settles_again()
        _say_refused(self.metrics, written.parked, first_held)

    def check_crowded(self) -> None:
        """Holding too many rows (Held.crowded) counts as the settlement failing (the module
        docstring): past the cap, the table refuses most rows' settlement."""
        held = self.held
        if not held.crowded() or (held.failing and not held.over_cap):
            return  # a failed write of the settlement backs off and counts on its own
        delay = held.crowded_out()
        self._count_failure()
        detail = (
            f"{held.jobs} published jobs ({held.bytes >> 10} KiB) held by the process: the table "
            f"refused their settlement, their parking and their parking in place; past the cap of "
            f"{MAX_HELD_ROWS} rows or {MAX_HELD_BYTES >> 20} MiB the table refuses most rows' settlement"
        )
        self._warn(leadership.Blocker(leadership.SETTLEMENT_FAILED, detail), delay, "they are")

    def _failed(self, to_settle: ToSettle, exc: psycopg.Error | errors.SettlementRefused) -> None:
        """The settlement of jobs already handed over could not be written: hold them, and try
        only that again, with backoff. A lost session raises: this drain writes them first when
        it leads again."""
        delay = self.held.failed(to_settle.jobs, to_settle.results)
        self._count_failure()
        if not self.store.alive:
            raise exc
        detail = f"{self.held.jobs} published jobs could not be settled (deleted): {errors.first_line(exc)}"
        self._warn(leadership.Blocker(leadership.SETTLEMENT_FAILED, detail), delay, "it is")

    def _count_failure(self) -> None:
        self.metrics.count_settlement_failure()
        self.metrics.set_unsettled(self.held.jobs)

    def _write(self, batch: store.Batch, decided: Settlement, *, careful: bool) -> writes.Refused:
        """Write the three parts of a settlement; return the rows the table refused, with why.
        The retry UPDATE and the burial each run in a savepoint: refused, they never undo the
        DELETE of delivered rows."""
        refused = batch.delete(decided.published, careful=careful)
        self.failpoints.hit("after_delete")
        refused |= batch.record_failures(decided.retry)
        refused |= batch.bury(decided.dead)
        return refused

    def _refused(
        self, batch: store.Batch, to_settle: ToSettle, decided: Settlement, refused: writes.Refused
    ) -> None:
        """The table refused the settlement of some rows: tell the table from the rows, then
        park or hold each refused row (the module docstring)."""
        published = {job.id for job in decided.published}
        dead = {row.job.id: row for row in decided.dead}
        known = self.held.refused_ids()
        later = {job.id for job in decided.locked}
        decided_jobs = [job for job in to_settle.jobs if job.id in to_settle.results and job.id not in later]
        fresh = [job for job in decided_jobs if job.id not in known]
        if fresh and all(job.id in refused for job in fresh):
            self._table_refuses(batch, _kinds(fresh, published, dead), fresh, refused, to_settle)
        decided.held, decided.parked = _park_or_hold(batch, decided_jobs, refused, published, dead)

    def _table_refuses(
        self,
        batch: store.Batch,
        kinds: list[str],
        fresh: list[models.StagedJob],
        refused: writes.Refused,
        to_settle: ToSettle,
    ) -> None:
        """Every fresh row was refused: raise SettlementRefused if the table refuses these kinds
        of write whichever row they name. A row of the drain's own tells; without one, the other
        due rows (not busy, not in this settlement) do."""
        test = batch.test_table(kinds)
        if isinstance(test, writes.ProbeFailure):
            raise errors.SettlementRefused(writes.refused_by_table(len(fresh), *test))
        if test:
            return
        exclude = to_settle.busy + [job.id for job in to_settle.jobs]
        probed, failure = batch.probe_due(self.settings.batch_size, self.paused(), exclude, kinds)
        if not probed:
            raise errors.SettlementRefused(
                f"the table refused the settlement of all {len(fresh)} rows (no row of its own, nor "
                f"another due row, to tell whether it refuses every row): {refused[fresh[0].id].why}"
            )
        if failure is not None:
            raise errors.SettlementRefused(writes.refused_by_table(len(fresh), *failure))

    # --- why this drain cannot settle, and for how long ----------------------------------------

    def cap(self, wait: float) -> float:
        """``wait``, but while this drain cannot settle never past the moment settle_timeout_s
        runs out: the next turn tries once more and ends the process on time."""
        if self.since is None:
            return wait
        return max(min(wait, self.since + self.settings.settle_timeout_s - self._clock()), 0.0)

    def retry_wait_s(self) -> float:
        """How long until a failing settlement is tried again: at once when this drain has been
        unable to settle for settle_timeout_s (that try ends the process on time)."""
        since = self.since
        out_of_time = since is not None and self._clock() - since >= self.settings.settle_timeout_s
        return 0.0 if out_of_time else self.held.wait_s()

    def stand_by(self, blocker: leadership.Blocker | None) -> None:
        """Say why this drain stands by, once per change of reason; ``blocker`` None: another
        drain leads."""
        table = self.store.names.qualified
        if blocker is None:
            self.since = None
            if self.said == ANOTHER_LEADS:
                return
            if self.said is not None:
                self.metrics.set_cannot_settle(None)
            self.said = ANOTHER_LEADS
            log.info(
                "standing by: another drain leads %s",
                table,
                extra={"event": "standing_by", "role": "standby", "table": table},
            )
            return
        if self.said != blocker.reason:
            log.warning(
                "standing by: %s",
                blocker.detail,
                extra={
                    "event": "standing_by",
                    "role": "standby",
                    "table": table,
                    "reason": blocker.reason,
                    "detail": blocker.detail,
                },
            )
        self._block(blocker)

    def forget_blocker(self) -> None:
        """No reason stands any more (leadership lost, or a step committed): the next one is
        said again."""
        self.said = None
        self.since = None
        self.metrics.set_cannot_settle(None)

    def _lock_wait_ms(self, most_ms: int) -> int:
        """A settlement's longest lock wait: ``most_ms``. While this drain cannot settle, no
        longer than the time settle_timeout_s leaves (at least 1 ms): a write waiting for a lock
        never carries the exit past it."""
        if self.since is None:
            return most_ms
        left_s = self.since + self.settings.settle_timeout_s - self._clock()
        return max(min(most_ms, int(left_s * 1000)), 1)

    def _block(self, blocker: leadership.Blocker) -> None:
        """Export the reason, and end the process (CannotSettle) once it lasted settle_timeout_s.
        An unbounded reason (Blocker.unbounded) has no time bound."""
        if self.said != blocker.reason:
            self.said = blocker.reason
            self.metrics.set_cannot_settle(blocker.reason)
        if blocker.unbounded:
            self.since = None
            return
        now = self._clock()
        if self.since is None:
            self.since = now
        elif now - self.since >= self.settings.settle_timeout_s:
            raise errors.CannotSettle(
                f"cannot settle for {now - self.since:.0f}s (settle_timeout_s): {blocker.detail}"
            )

    def _warn(self, blocker: leadership.Blocker, delay: float, what: str) -> None:
        """Say once per reason that this leader cannot settle (``what`` is written again in
        ``delay`` seconds), then export it and end the process on time (``_block``)."""
        if self.said != blocker.reason:
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
                    "unsettled": self.held.jobs,
                    "retry_in_s": round(delay, 3),
                },
            )
        self._block(blocker)

    def _settles_again(self) -> None:
        """A step committed after this drain could not settle: say so once, clear the reason."""
        if self.said not in (None, ANOTHER_LEADS):
            log.info(
                "settling again: published jobs are deleted",
                extra={"event": "settling_again", "role": "leader", "reason": self.said},
            )
        self.forget_blocker()
        self.metrics.set_unsettled(self.held.jobs)


def _kinds(fresh: list[models.StagedJob], published: set[int], dead: dict[int, writes.Dead]) -> list[str]:
    """The kinds of write the settlement of ``fresh`` asked of the table, in probing order."""
    asked = {
        writes.DELETE if j.id in published else writes.BURY if j.id in dead else writes.RETRY for j in fresh
    }
    return [kind for kind in writes.PROBE_KINDS if kind in asked]


def _park_or_hold(
    batch: store.Batch,
    jobs: list[models.StagedJob],
    refused: writes.Refused,
    published: set[int],
    dead: dict[int, writes.Dead],
) -> tuple[list[models.StagedJob], Parked]:
    """Park each refused row of ``jobs`` or hold it (the module docstring); return (held, parked)."""
    held: list[models.StagedJob] = []
    parked: Parked = []
    for job in jobs:
        if job.id not in refused:
            continue
        why, passing = refused[job.id]
        if job.id in published:
            note = f"published to backend {job.backend}, but the table refused its DELETE: {why}"
        elif job.id in dead:
            row = dead[job.id]
            note = f"dead after {row.attempts} attempts ({row.error}); the table refused its burial: {why}"
        else:
            held.append(job)  # its backoff was refused: tried again, it was not delivered
            continue
        if passing:
            held.append(job)  # a lock wait, a serialization failure: written again, not parked
            continue
        if batch.park(job, f"{writes.PARKED_PREFIX} {note}"):
            parked.append((job, f"{writes.PARKED_PREFIX} {note}"))
            continue
        note = (
            f"{writes.PARKED_IN_PLACE_PREFIX} {note}; the table refused its parking (run_at "
            f"{writes.PARKED_AT.date()}) too, so its run_at stays"
        )
        if batch.park_in_place(job, note):
            parked.append((job, note))
        else:
            held.append(job)
    return held, parked


# --- the rows this process holds -------------------------------------------------------------


class Held:
    """Jobs handed to their backend whose settlement is not written yet, with their results, by
    row id. A later step writes them and forgets them.

    Three kinds:
        - locked: another transaction locks the row; the next step writes it;
        - refused: tried again after a backoff of its own (RETRY_MIN_S doubling to REFUSED_MAX_S);
        - ``failing``: a step's whole settlement failed; tried again after ``wait_s()``.

    Bounds:
        Every row held is left out of every select. A job is held without its content (``slim``),
        and the rows held are capped (``crowded``).
    """

    def __init__(self, *, clock: Callable[[], float], rand: Callable[[], float]) -> None:
        self._jobs: dict[int, models.StagedJob] = {}
        self._results: dict[int, models.PublishResult] = {}
        self._bytes = 0  # held_bytes of every job held
        self._max_rows = MAX_HELD_ROWS
        self._max_bytes = MAX_HELD_BYTES
        self._refused: dict[int, tuple[int, float]] = {}  # row id -> (times refused, next try at)
        self._clock = clock
        self._retries = backoff.Backoff(RETRY_MIN_S, RETRY_MAX_S, rand)
        self._refused_backoff = backoff.Backoff(RETRY_MIN_S, REFUSED_MAX_S, rand)
        self._next_at = 0.0
        self.failing = False
        self.over_cap = False  # failing because crowded (crowded_out), not for a failed write

    def __bool__(self) -> bool:
        return bool(self._jobs)

    @property
    def jobs(self) -> int:
        return len(self._jobs)

    @property
    def bytes(self) -> int:
        """An upper estimate of what the jobs held take (held_bytes)."""
        return self._bytes

    def crowded(self) -> bool:
        """Whether the process holds as many rows as it may (MAX_HELD_ROWS, MAX_HELD_BYTES): the
        relay then selects nothing new, as when a settlement fails."""
        return len(self._jobs) >= self._max_rows or self._bytes >= self._max_bytes

    def all(self) -> list[models.StagedJob]:
        """The jobs held, as held (``slim``)."""
        return list(self._jobs.values())

    def row_ids(self) -> list[int]:
        return list(self._jobs)

    def refused_ids(self) -> set[int]:
        """The rows held because the table refused their settlement."""
        return set(self._refused)

    def pending(self) -> tuple[list[models.StagedJob], dict[int, models.PublishResult]]:
        """The jobs to settle in the next step, with their results (still held here until then):
        all but the refused ones whose backoff is not up."""
        now = self._clock()
        due = [job for row_id, job in self._jobs.items() if self._refused.get(row_id, (0, now))[1] <= now]
        return due, {job.id: self._results[job.id] for job in due}

    def next_try_s(self) -> float | None:
        """Seconds until the earliest refused row's next try (0 if one is due); None if none."""
        if not self._refused:
            return None
        return max(min(at for _, at in self._refused.values()) - self._clock(), 0.0)

    def keep(self, jobs: Iterable[models.StagedJob], results: Mapping[int, models.PublishResult]) -> None:
        """Hold these jobs (those with a result: the others were not handed over) until settled."""
        for job in jobs:
            if job.id not in results:
                continue
            self._forget(job.id)
            kept, result = slim(job), _kept(results[job.id])
            self._jobs[job.id] = kept
            self._results[job.id] = result
            self._bytes += held_bytes(kept, result)

    def _forget(self, row_id: int) -> None:
        kept, result = self._jobs.pop(row_id, None), self._results.pop(row_id, None)
        if kept is not None and result is not None:
            self._bytes -= held_bytes(kept, result)

    def settled(
        self,
        taken: Iterable[models.StagedJob],
        locked: Iterable[models.StagedJob],
        refused: Iterable[models.StagedJob],
        results: Mapping[int, models.PublishResult],
    ) -> list[models.StagedJob]:
        """A step committed the settlement of the ``taken`` jobs (those ``pending`` gave it) but
        ``locked`` and ``refused`` ones; return the refused ones held for the first time."""
        for job in taken:
            self._forget(job.id)
        self.keep(locked, results)
        first = []
        now = self._clock()
        for job in refused:
            times = self._refused.get(job.id, (0, 0.0))[0] + 1
            self._refused[job.id] = (times, now + self._refused_backoff.delay(times))
            if times == 1:
                first.append(job)
        self.keep(refused, results)
        for row_id in self._refused.keys() - self._jobs.keys():
            del self._refused[row_id]  # written at last
        self._set_failing(False)
        return first

    def failed(self, jobs: Iterable[models.StagedJob], results: Mapping[int, models.PublishResult]) -> float:
        """Writing the settlement of ``jobs`` failed: keep them, back off; return the wait."""
        self.keep(jobs, results)
        return self._set_failing(True)

    def crowded_out(self) -> float:
        """The process holds too many rows (``crowded``): count it as a failing settlement (the
        relay publishes nothing new, only tries the held rows again), back off; return the wait."""
        return self._set_failing(True, over_cap=True)

    def wait_s(self) -> float:
        """How long until the next attempt to write a failing settlement."""
        return max(self._next_at - self._clock(), 0.0)

    def clear(self) -> None:
        self._jobs.clear()
        self._results.clear()
        self._bytes = 0
        self._refused.clear()
        self._set_failing(False)

    def _set_failing(self, failing: bool, *, over_cap: bool = False) -> float:
        """The one place ``failing`` changes: failing, back off (return the wait); else reset."""
        self.failing, self.over_cap = failing, over_cap
        if not failing:
            self._retries.reset()
            self._next_at = 0.0
            return 0.0
        delay = self._retries.next()
        self._next_at = self._clock() + delay
        return delay


def slim(job: models.StagedJob) -> models.StagedJob:
    """What a held job keeps: what its settlement needs (ids, names, attempts, times), not its
    content (arguments, options, trace context). A settlement names rows; a burial copies the
    row from the table."""
    return dataclasses.replace(
        job, args=(), kwargs=_EMPTY, options=_EMPTY, traceparent=None, tracestate=None, memory_bytes=0
    )


def _kept(result: models.PublishResult) -> models.PublishResult:
    """A result as held: its error cut to what a settlement writes (MAX_ERROR_CHARS)."""
    if result.error is None or len(result.error) <= MAX_ERROR_CHARS:
        return result
    return dataclasses.replace(result, error=result.error[:MAX_ERROR_CHARS])


def held_bytes(job: models.StagedJob, result: models.PublishResult) -> int:
    """An upper estimate of what one held job and its result take: HELD_ROW_BYTES, and each text
    at a byte a character if ASCII, else 4 (a UCS-4 string): Python's own sizes."""
    texts = (job.job_name, job.queue, job.backend, job.unreadable or "", result.error or "")
    return HELD_ROW_BYTES + sum(len(text) if text.isascii() else 4 * len(text) for text in texts)


def _say_refused(
    metrics_: metrics.Metrics,
    parked: list[tuple[models.StagedJob, str]],
    first_held: Iterable[models.StagedJob],
) -> None:
    """Log each row parked, and each held for the first time; count them."""
    first_held = list(first_held)
    if not parked and not first_held:
        return
    metrics_.count_settlement_failure()
    metrics_.count_parked(len(parked))
    for job, note in parked:
        log.warning(
            "job %s (%s) parked: %s",
            job.job_id,
            job.job_name,
            note,
            extra=_refused_fields(job, "parked", reason=note),
        )
    for job in first_held:
        log.warning(
            "job %s (%s): the table refused its settlement, or its parking and its parking in "
            "place; held out of selection, tried again with backoff",
            job.job_id,
            job.job_name,
            extra=_refused_fields(job, "held"),
        )


def _refused_fields(job: models.StagedJob, action: str, **more: str) -> dict[str, object]:
    """A settlement_refused log record's fields for one job."""
    return {
        "event": "settlement_refused",
        "action": action,
        "backend": job.backend,
        "queue": job.queue,
        "job_ids": [str(job.job_id)],
        **more,
    }
