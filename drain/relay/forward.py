"""Forwarding: every call into an adapter, and what the relay remembers of the backends.

The Forwarder hands a step's jobs to their backends and returns a result per job. It owns:

- the adapters, each open, closed or paused;
- the step's budget and the order of its calls;
- the pacing of queues whose jobs all come back as retries;
- the flights: batches submitted to a pipelined backend and not collected yet.

What a call's outcome means::

    BackendUnavailable                 -> an outage: the backend is paused (0.5 s doubling to
                                          30 s, jittered); its jobs get no result, rows untouched
    a backend that failed this step    -> not called again until the next step; its flights are
                                          collected at once: what the broker confirmed is
                                          settled, the rest get no result
    anything else raised               -> the batch is published again one job at a time; a job
                                          whose own publish raises is rejected with the error
                                          (every job raised and the ping fails: an outage)
    the step's budget is used up       -> the backends not called yet wait for the next step,
                                          the least recently called first: none waits for ever
    a backend answers                  -> it is up again (drain_backend_up 1)
    a queue's jobs all come back RETRY -> they wait longer each time (1-2 s doubling to 30 s,
                                          jittered) until one of them is published
    every job RETRY, across queues     -> the backend's outage, as if it had raised

Why a budget:
    Several backends that each hang up to their own timeout would together outlive the
    session's fences.

Why so much care with an error:
    One row an adapter cannot handle is that row's rejection, never a crash nor an outage. An
    outage never counts an attempt against any row.

Flights:
    - A pipelined backend (RabbitMQ) is only handed a batch. A later step collects its confirms,
      after submitting its own: the broker persists one batch while the relay reads the next.
    - At most ``depth`` groups stay in flight. A group older than MAX_AGE_S is collected by the
      next step whatever the depth: other backends can keep batches full for ever.
    - The rows in flight are left out of the next selects.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar, cast

from drain import backend, errors, models
from drain.backend import Adapter, PipelinedAdapter
from drain.observability import logs, metrics, tracing
from drain.relay import backoff, failpoints

log = logging.getLogger(__name__)

UNKNOWN_BACKEND = "no backend named {!r} is configured"
PAUSE_MIN_S = 0.5
PAUSE_MAX_S = 30.0
NACKED_MIN_S = 2.0  # times the jitter factor [0.5, 1): settlement's usual 1-2 s for a nack
NACKED_MAX_S = 30.0
MAX_NACKED_QUEUES = 10_000  # queues with a streak of refusals remembered at once
MAX_AGE_S = 1.0  # the longest a flight waits to be collected

Results = dict[int, models.PublishResult]
_Answer = TypeVar("_Answer", "Flight", Results)


@dataclasses.dataclass
class Flight:
    """One backend's share of one batch, submitted and not yet collected."""

    backend: str
    jobs: list[models.StagedJob]
    ticket: object
    submitted_at: float


class Forwarder:
    """Calls into the adapters for the relay; use from one thread."""

    def __init__(
        self,
        adapters: Mapping[str, Adapter],
        *,
        metrics_: metrics.Metrics,
        failpoints_: failpoints.Failpoints,
        clock: Callable[[], float],
        rand: Callable[[], float],
        step_budget_s: float | None = None,
        fence_s: float | None = None,
    ) -> None:
        self.adapters = dict(adapters)
        self.fence_s = fence_s
        """No row is published this long after its select returned (``_require_session``)."""
        self.pipelined = {
            name for name, adapter in self.adapters.items() if isinstance(adapter, PipelinedAdapter)
        }
        self.full_only = {
            name for name in self.pipelined if getattr(self.adapters[name], "full_batches_only", False)
        }
        """Pipelined backends submitted only full batches (PipelinedAdapter)."""
        self.step_budget_s = step_budget_s
        """No backend is called for the first time in a step that began longer ago than this."""
        self.failed: set[str] = set()
        """Backends found unavailable since ``begin_step``."""
        self.deferred: set[str] = set()
        """Backends not called in this step because its budget was used up."""
        self._open: set[str] = set()
        self._paused_until: dict[str, float] = {}
        self._pauses: dict[str, backoff.Backoff] = {}
        """Each backend paused, or not called since its pause: its streak of outages."""
        self._pause_backoff = backoff.Backoff(PAUSE_MIN_S, PAUSE_MAX_S, rand)
        self._last_called: dict[str, float] = {}
        """When each backend was last called: the least recently called go first in a step."""
        self._nack_backoff = backoff.Backoff(NACKED_MIN_S, NACKED_MAX_S, rand)
        self._nack_streaks: dict[tuple[str, str], backoff.Backoff] = {}
        """(backend, queue) -> its streak of calls in which every job came back RETRY."""
        self._flights: collections.deque[list[Flight]] = collections.deque()
        """Groups of flights, one per step that submitted, oldest first."""
        self.max_age_s = MAX_AGE_S
        self._metrics = metrics_
        self._failpoints = failpoints_
        self._clock = clock

    # --- the step -----------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A step begins: no backend has failed in it, none was deferred."""
        self.failed = set()
        self.deferred = set()

    def forward(
        self, jobs: Sequence[models.StagedJob], *, submit: bool, full: bool = True
    ) -> tuple[Results, list[Flight]]:
        """Publish each backend's share of ``jobs``; return the results and the new flights.

        With ``submit``, a pipelined backend's share is only handed over: it becomes a flight,
        collected by a later step (a backend that pipelines only full batches: when ``full``). A
        job the drain could not read (``unreadable``) is rejected with its reason, as is one for
        an unknown backend or one the ``refuse_first`` failpoint refuses.
        """
        by_backend: dict[str, list[models.StagedJob]] = collections.defaultdict(list)
        results: Results = {}
        refusing = self._failpoints.refuse_every > 0
        for job in jobs:
            if job.unreadable is not None:  # no backend sees a row the drain could not read
                results[job.id] = models.PublishResult.rejected(job, job.unreadable)
            elif refusing and self._failpoints.refuses(job.id, job.attempts):
                results[job.id] = _refused(job)
            else:
                by_backend[job.backend].append(job)
        flights: list[Flight] = []
        ordered = sorted(by_backend.items(), key=lambda item: self._call_order(item[0]))
        started, called = self._clock(), False  # the budget: from here (after the select)
        for index, (name, group) in enumerate(ordered):
            if index:
                self._failpoints.hit("mid_publish")
            if name not in self.adapters:
                reason = UNKNOWN_BACKEND.format(name)
                results.update((job.id, models.PublishResult.rejected(job, reason)) for job in group)
                continue
            if called and self._over_budget(started):
                # No result: its rows wait for the next step. The first backend called is never
                # deferred (rows naming an unknown backend, rejected at once, took that place
                # each step).
                self.deferred.add(name)
                self._metrics.count_deferred(name)
                continue
            _require_session(group, self.fence_s)
            called = True
            if submit and name in self.pipelined and (full or name not in self.full_only):
                with tracing.forward_span(name, group):
                    flight = self._call(name, group, self._submit, answers=False)
                if isinstance(flight, Flight):
                    flights.append(flight)
                elif flight is not None:  # published one by one
                    results.update(flight)
            else:
                with tracing.forward_span(name, group):
                    answer = self._call(name, group, lambda a, g: _answered(g, a.publish_batch(g)))
                if answer is not None:
                    results.update(self._pace(group, answer))
        if flights:
            self._flights.append(flights)
        return results, flights

    def collect_due(self, *, keep: int) -> tuple[list[Flight], list[Flight], Results]:
        """Collect the flights due: all but the newest ``keep`` groups, and any group older than
        ``max_age_s``. Then give up the flights of every backend that failed in this step, and
        collect what the broker confirmed of them. Return (due, given up, their results)."""
        now = self._clock()
        due: list[Flight] = []
        while self._flights and (
            len(self._flights) > keep or now - self._flights[0][0].submitted_at > self.max_age_s
        ):
            due.extend(self._flights.popleft())
        results = self._collect(due)
        given_up: list[Flight] = []
        if self.failed:
            failed = self.failed
            given_up = [flight for flight in self.flights() if flight.backend in failed]
            kept = ([flight for flight in group if flight.backend not in failed] for group in self._flights)
            self._flights = collections.deque(group for group in kept if group)
            results.update(self._collect(given_up))
        return due, given_up, results

    def _collect(self, flights: list[Flight]) -> Results:
        """The results of submitted flights, in submission order."""
        results: Results = {}
        for flight in flights:
            if flight.backend in self.failed:
                pipelined = cast(PipelinedAdapter, self.adapters[flight.backend])
                results.update(_settled_before_failure(pipelined, flight))
                continue

            def collect(
                adapter: Adapter, jobs: Sequence[models.StagedJob], ticket: object = flight.ticket
            ) -> Results:
                return _answered(jobs, cast(PipelinedAdapter, adapter).collect(ticket))

            answer = self._call(flight.backend, flight.jobs, collect)
            if answer is not None:
                results.update(self._pace(flight.jobs, answer))
        return results

    # --- the flights --------------------------------------------------------------------------

    def flights(self) -> Iterator[Flight]:
        """Every flight, oldest first."""
        return (flight for group in self._flights for flight in group)

    @property
    def in_flight(self) -> int:
        """The jobs in flight."""
        return sum(len(flight.jobs) for flight in self.flights())

    @property
    def in_flight_bytes(self) -> int:
        """What the jobs in flight weigh (drain.store.reading): it counts against batch_max_bytes."""
        return sum(job.memory_bytes for flight in self.flights() for job in flight.jobs)

    @property
    def has_flights(self) -> bool:
        return bool(self._flights)

    def in_flight_ids(self) -> list[int]:
        """The rows in flight: the selects leave them out."""
        return [job.id for flight in self.flights() for job in flight.jobs]

    def forget_flights(self) -> None:
        """Forget every flight: their rows were not deleted, and go again."""
        self._flights.clear()

    # --- the backends -------------------------------------------------------------------------

    def paused(self) -> list[str]:
        """The backends paused after an outage: their rows are not selected."""
        now = self._clock()
        return [name for name, until in self._paused_until.items() if until > now]

    def pause_streak(self, name: str) -> int:
        """How many times in a row ``name`` was found unavailable (0: it is not paused)."""
        pause = self._pauses.get(name)
        return 0 if pause is None else pause.count

    def close_all(self) -> None:
        for name in list(self._open):
            self._close(name)

    def _call_order(self, name: str) -> float:
        """The least recently called first (never called: first of all), whatever their past.

        So a backend deferred by the budget goes first in a later step: a slow but healthy one
        cannot keep another waiting. Nor can it keep one that recovered from a pause: ordered
        after every backend without a streak, that one would never be called, so never clear its
        streak. One that hangs again costs one step per pause.
        """
        return self._last_called.get(name, float("-inf"))

    def _over_budget(self, started: float) -> bool:
        budget = self.step_budget_s
        return budget is not None and self._clock() - started >= budget

    def _submit(self, adapter: Adapter, jobs: Sequence[models.StagedJob]) -> Flight:
        ticket = cast(PipelinedAdapter, adapter).submit(jobs)
        return Flight(backend=jobs[0].backend, jobs=list(jobs), ticket=ticket, submitted_at=self._clock())

    def _call(
        self,
        name: str,
        jobs: Sequence[models.StagedJob],
        call: Callable[[Adapter, Sequence[models.StagedJob]], _Answer],
        *,
        answers: bool = True,
    ) -> _Answer | Results | None:
        """``call(adapter, jobs)`` with its failures translated (the module docstring).

        Returns what ``call`` returned, the net's per-job results, or None: the backend is
        unavailable (at once, without calling, if it already failed in this step).

        Only a call that ``answers`` for the broker ends a pause. A submit only handed bytes to a
        socket: a blocked broker takes them too, and resuming there would restart the pause's
        backoff at every retry.
        """
        if name in self.failed:
            return None
        self._last_called[name] = self._clock()
        adapter = self.adapters[name]
        try:
            self._ensure_open(name)
            answer = call(adapter, jobs)
        except errors.BackendUnavailable as exc:
            self._pause(name, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - the net: see _one_by_one
            return self._one_by_one(name, jobs, exc)
        if isinstance(answer, dict):
            _fill_missing(name, jobs, answer)
            everywhere = _refused_everywhere(name, jobs, answer)
            if everywhere is not None:
                self._pause(name, everywhere)
                return None
        if answers:
            self._resume(name)
        return answer

    def _one_by_one(self, name: str, jobs: Sequence[models.StagedJob], first: Exception) -> Results | None:
        """A batch call raised something unexpected: find the rows at fault by publishing each
        job alone (a job already published may be published again: at least once)."""
        reason = f"{type(first).__name__}: {errors.first_line(first)}"
        log.warning(
            "backend %s: a batch of %d failed with %s: %s; publishing its jobs one by one",
            name,
            len(jobs),
            type(first).__name__,
            errors.first_line(first),
            extra={
                "event": "batch_failed",
                "backend": name,
                "batch_size": len(jobs),
                "job_ids": logs.job_ids(jobs),
                "reason": reason,
            },
        )
        log.debug("backend %s: the batch failure", name, exc_info=first, extra={"backend": name})
        self._close(name)
        adapter = self.adapters[name]
        answered: Results = {}
        raised: dict[int, Exception] = {}
        for job in jobs:
            try:
                self._ensure_open(name)
                answered.update(_answered([job], adapter.publish_batch([job])))
            except errors.BackendUnavailable as exc:
                self._pause(name, exc)
                return answered  # the rest stay untouched
            except Exception as exc:  # noqa: BLE001 - this job's rejection (or an outage, below)
                raised[job.id] = exc
                self._close(name)
        if raised and len(raised) == len(jobs) and not self._answers_ping(name):
            return None
        _fill_missing(name, [job for job in jobs if job.id not in raised], answered)
        for job in jobs:
            if job.id in raised:
                reason = backend.refusal_text(name, raised[job.id], with_type=True)
                answered[job.id] = models.PublishResult.rejected(job, reason)
        self._resume(name)
        return answered

    def _ensure_open(self, name: str) -> None:
        """Open the backend unless open; a backend that cannot open is unavailable (raises)."""
        if name in self._open:
            return
        try:
            self.adapters[name].open()
        except errors.BackendUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - a backend that cannot open is unavailable
            raise errors.BackendUnavailable(
                f"{name}: cannot open: {type(exc).__name__}: {errors.first_line(exc)}"
            ) from None
        self._open.add(name)

    def _pause(self, name: str, exc: errors.BackendUnavailable) -> None:
        """Pause a backend found unavailable, once per step however many of its calls fail."""
        if name in self.failed:
            return
        self.failed.add(name)
        pause = self._pauses.setdefault(name, dataclasses.replace(self._pause_backoff))
        delay = pause.next()
        self._paused_until[name] = self._clock() + delay
        self._close(name)
        self._metrics.set_backend_up(name, False)
        reason = errors.first_line(exc)
        log.warning(
            "backend %s unavailable, retrying in %.1fs: %s",
            name,
            delay,
            reason,
            extra={
                "event": "backend_unavailable",
                "backend": name,
                "retry_in_s": round(delay, 3),
                "attempts": pause.count,
                "reason": reason,
            },
        )

    def _resume(self, name: str) -> None:
        """The backend answered: up again."""
        self._paused_until.pop(name, None)
        if self._pauses.pop(name, None) is not None:
            log.info(
                "backend %s is available again", name, extra={"event": "backend_available", "backend": name}
            )
        self._metrics.set_backend_up(name, True)

    def _answers_ping(self, name: str) -> bool:
        """Whether the backend answers a ping; if not, it is unavailable (paused)."""
        try:
            self._ensure_open(name)
            self.adapters[name].ping()
        except Exception as exc:  # noqa: BLE001 - any failure to answer a ping is an outage
            unavailable = (
                exc
                if isinstance(exc, errors.BackendUnavailable)
                else errors.BackendUnavailable(f"{name}: {type(exc).__name__}: {errors.first_line(exc)}")
            )
            self._pause(name, unavailable)
            return False
        return True

    def _close(self, name: str) -> None:
        if name in self._open:
            self._open.discard(name)
            try:
                self.adapters[name].close()
            except Exception as exc:  # noqa: BLE001 - closing a broken connection may fail
                reason = type(exc).__name__
                log.debug(
                    "closing backend %s failed: %s", name, reason, extra={"backend": name, "reason": reason}
                )

    def _pace(self, jobs: Sequence[models.StagedJob], results: Results) -> Results:
        """Give a queue's RETRY results a longer wait each time none of its jobs in the call
        was published (a streak per backend and queue); a publish ends the streak."""
        by_queue: dict[tuple[str, str], list[models.PublishResult]] = collections.defaultdict(list)
        for job in jobs:
            if (result := results.get(job.id)) is not None:
                by_queue[job.backend, job.queue].append(result)
        for key, answered in by_queue.items():
            if any(result.outcome is models.Outcome.PUBLISHED for result in answered):
                if self._nack_streaks.pop(key, None) is not None:
                    _say_refusing(self._metrics, key, False)
                continue
            retried = [result for result in answered if result.outcome is models.Outcome.RETRY]
            if not retried:
                continue
            if key not in self._nack_streaks and len(self._nack_streaks) >= MAX_NACKED_QUEUES:
                for forgotten in self._nack_streaks:  # forgetting streaks only shortens waits
                    _say_refusing(self._metrics, forgotten, False)
                self._nack_streaks.clear()
            streak = self._nack_streaks.setdefault(key, dataclasses.replace(self._nack_backoff))
            streak.count += 1
            for result in retried:
                delay = streak.delay(streak.count)
                results[result.row_id] = dataclasses.replace(result, retry_after_s=delay)
            _say_refusing(self._metrics, key, True, len(retried), retried[0].error)
        return results


def _answered(jobs: Sequence[models.StagedJob], answered: Sequence[models.PublishResult]) -> Results:
    """One call's results for these jobs, by row id (an adapter's stray result for another row is
    ignored)."""
    wanted = {job.id for job in jobs}
    return {result.row_id: result for result in answered if result.row_id in wanted}


def _fill_missing(name: str, jobs: Sequence[models.StagedJob], results: Results) -> None:
    """A job the adapter did not answer is a RETRY (it may or may not have been published)."""
    for job in jobs:
        if job.id not in results:
            results[job.id] = models.PublishResult.retry(job, f"{name}: no result returned")


def _refused_everywhere(
    name: str, jobs: Sequence[models.StagedJob], results: Results
) -> errors.BackendUnavailable | None:
    """A call none of whose jobs was published nor rejected, across more than one queue: what
    every queue refuses is the backend's (an outage: the rows stay untouched), not the queues'."""
    queues = {job.queue for job in jobs}
    if len(queues) < 2 or any(result.outcome is not models.Outcome.RETRY for result in results.values()):
        return None
    first = next(iter(results.values()), None)
    why = (first.error if first is not None else None) or "no result"
    return errors.BackendUnavailable(
        f"{name}: every job of {len(queues)} queues came back unpublished: {why}"
    )


def _settled_before_failure(adapter: PipelinedAdapter, flight: Flight) -> Results:
    """What the broker confirmed of a flight before its backend failed in this step.

    - The backend was closed when it failed, so ``collect`` returns at once (PipelinedAdapter).
    - Dropping the flight instead would publish its confirmed jobs again: duplicates.
    - When it raises (nothing of it settled), its rows stay untouched and go again.
    """
    try:
        answered = adapter.collect(flight.ticket)
    except Exception:  # noqa: BLE001 - nothing settled: its rows go again
        return {}
    return _answered(flight.jobs, answered)


def _say_refusing(
    metrics_: metrics.Metrics, key: tuple[str, str], refusing: bool, jobs: int = 0, error: str | None = None
) -> None:
    """Say that a queue refuses its jobs (or accepts them again), in a line and the gauge."""
    backend_name, queue = key
    metrics_.set_queue_refusing(backend_name, queue, refusing)
    if not refusing:
        log.info(
            "backend %s: queue %s accepts jobs again",
            backend_name,
            logs.one_line(queue)[:100],
            extra={"event": "queue_accepting", "backend": backend_name, "queue": queue[:100]},
        )
        return
    reason = logs.one_line(error or "no result")[:300]
    log.warning(
        "backend %s: queue %s refuses its jobs (%d wait, uncounted): %s",
        backend_name,
        logs.one_line(queue)[:100],
        jobs,
        reason,
        extra={
            "event": "queue_refusing",
            "backend": backend_name,
            "queue": queue[:100],
            "reason": reason,
        },
    )


def _require_session(group: Sequence[models.StagedJob], fence_s: float | None) -> None:
    """Refuse to publish rows selected ``fence_s`` ago or longer: the session's
    idle-in-transaction timeout. A process paused that long (SIGSTOP, a frozen VM) has lost its
    session and the lock with it; another leader may have published these rows, and the next of
    their keys, since. Sent now, they would arrive after those."""
    read_at = group[0].read_at  # 0: a job no select read (tests)
    if fence_s is not None and read_at > 0 and time.monotonic() - read_at >= fence_s:
        raise errors.LeadershipLost(
            f"the rows were selected {time.monotonic() - read_at:.1f} s ago, past the "
            f"session's fence ({fence_s:g} s): the lock may be another drain's; not published"
        )


def _refused(job: models.StagedJob) -> models.PublishResult:
    """The ``refuse_first`` failpoint's rejection, logged (a test counts them in the log)."""
    reason = failpoints.REFUSED.format(job.id)
    log.warning(reason, extra={"event": "failpoint_refused", "job_ids": [str(job.job_id)]})
    return models.PublishResult.rejected(job, reason)
