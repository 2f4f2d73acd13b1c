"""Every call into an adapter, in the order and within the budget of a step, with its failures
translated (which backends are open or paused, and which queues refuse their jobs:
drain.relay.availability).

::

    adapter raises BackendUnavailable  -> the backend is paused (backoff 0.5 s doubling to 30 s,
                                          jittered); its jobs get no result: rows untouched
    a backend that failed in this step -> not called again until the next step: its other
                                          batches in flight get no result either (no reconnect
                                          per batch: the step's waits stay within one bound)
    adapter raises anything else       -> the net behind the adapters' own validation: the
                                          batch is published again one job at a time; a job
                                          whose own publish raises is REJECTED with the error —
                                          unless every job raised and the backend fails its
                                          ping, which makes the backend unavailable instead
    the step's budget is used up       -> the backends not yet called this step are not called:
                                          their rows wait for the next step, untouched (several
                                          backends that each hang up to their own timeout
                                          would together outlive the session's fences). The
                                          least recently called go first: none waits for
                                          ever.
    a backend answers                  -> it is up again (drain_backend_up 1)
    a queue's jobs all RETRY (nacked)  -> they wait longer each time (1-2 s doubling to 30 s,
                                          jittered), until one of that queue's jobs is published:
                                          a full queue (max-length with reject-publish) is held
                                          back without holding back the other queues

So one row an adapter cannot handle is that row's rejection, never a crash and never an outage,
and an outage never counts an attempt against any row.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import cast

from drain import backend, errors, models
from drain.backend import Adapter, PipelinedAdapter
from drain.observability import logs, metrics, tracing
from drain.relay import availability, failpoints, pipeline

log = logging.getLogger(__name__)

UNKNOWN_BACKEND = "no backend named {!r} is configured"

Results = availability.Results


class BackendGate:
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
    ) -> None:
        self.adapters = dict(adapters)
        self.step_budget_s = step_budget_s
        """No backend is called for the first time in a step that began longer ago than this."""
        self.deferred: set[str] = set()
        """Backends not called in this step because its budget was used up."""
        self._last_called: dict[str, float] = {}
        """When each backend was last called: the least recently called go first in a step."""
        self.pipelined = {
            name for name, adapter in self.adapters.items() if isinstance(adapter, PipelinedAdapter)
        }
        self.backends = availability.Availability(self.adapters, metrics_=metrics_, clock=clock, rand=rand)
        self._nacked = availability.NackedQueues(rand)
        self._metrics = metrics_
        self._failpoints = failpoints_
        self._clock = clock

    @property
    def failed(self) -> set[str]:
        """Backends found unavailable since ``begin_step``."""
        return self.backends.failed

    def begin_step(self) -> None:
        self.backends.failed = set()
        self.deferred = set()

    def pause_streak(self, name: str) -> int:
        """How many times in a row ``name`` was found unavailable (0: it is not paused)."""
        return self.backends.pause_streak(name)

    def paused(self) -> list[str]:
        return self.backends.paused()

    def close_all(self) -> None:
        self.backends.close_all()

    def _call_order(self, name: str) -> float:
        """The least recently called first (never called: first of all), whatever their past: a
        backend deferred by the budget goes first in a later step, so a slow but healthy one
        cannot keep another waiting (red team 27), nor can it keep one that recovered from a
        pause (red team 28: ordered after every backend without a streak, it was deferred, never
        called, so never cleared its streak). One that hangs again costs one step per pause."""
        return self._last_called.get(name, float("-inf"))

    def _over_budget(self, started: float) -> bool:
        budget = self.step_budget_s
        return budget is not None and self._clock() - started >= budget

    # --- forwarding -------------------------------------------------------------------------

    def forward(
        self, jobs: Sequence[models.StagedJob], *, submit: bool
    ) -> tuple[Results, list[pipeline.Flight]]:
        """Publish each backend's share of ``jobs`` now, or (``submit``, pipelined backends) only
        hand it over and return it as a flight to collect later. A job the drain could not read
        (``unreadable``) is REJECTED with its reason, like one for an unknown backend, as is one
        the ``refuse_first`` failpoint refuses."""
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
        flights: list[pipeline.Flight] = []
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
                # each step: red team 29).
                self.deferred.add(name)
                self._metrics.count_deferred(name)
                continue
            called = True
            if submit and name in self.pipelined:
                with tracing.forward_span(name, group):
                    ticket = self._call(
                        name, group, lambda a, g: cast(PipelinedAdapter, a).submit(g), answers=False
                    )
                if isinstance(ticket, _Answered):
                    results.update(ticket.results)
                elif ticket is not _UNAVAILABLE:
                    flights.append(pipeline.Flight(name, group, ticket, self._clock()))
            else:
                with tracing.forward_span(name, group):
                    answer = self._call(name, group, lambda a, g: _Answered.of(g, a.publish_batch(g)))
                if isinstance(answer, _Answered):
                    results.update(self._nacked.pace(group, answer.results))
        return results, flights

    def collect(self, flights: Iterable[pipeline.Flight]) -> Results:
        """The results of submitted flights, in submission order."""
        results: Results = {}
        for flight in flights:

            def collect(
                adapter: Adapter, jobs: Sequence[models.StagedJob], ticket: object = flight.ticket
            ) -> object:
                return _Answered.of(jobs, cast(PipelinedAdapter, adapter).collect(ticket))

            answer = self._call(flight.backend, flight.jobs, collect)
            if isinstance(answer, _Answered):
                results.update(self._nacked.pace(flight.jobs, answer.results))
        return results

    def _call(
        self,
        name: str,
        jobs: Sequence[models.StagedJob],
        call: Callable[[Adapter, Sequence[models.StagedJob]], object],
        *,
        answers: bool = True,
    ) -> object:
        """``call(adapter, jobs)`` with failures translated (see the module docstring).

        Returns what ``call`` returned, an _Answered (the net's per-job results), or _UNAVAILABLE
        (at once, without calling, for a backend that already failed in this step). A call
        that returns makes a paused backend available again only if it ``answers`` for the
        broker: a submit only handed bytes to a socket (a blocked broker takes them too,
        and resuming there would restart the pause's backoff at every retry).
        """
        if name in self.failed:
            return _UNAVAILABLE
        self._last_called[name] = self._clock()
        adapter = self.adapters[name]
        try:
            self.backends.ensure_open(name)
            answer = call(adapter, jobs)
        except errors.BackendUnavailable as exc:
            self.backends.fail(name, exc)
            return _UNAVAILABLE
        except Exception as exc:  # noqa: BLE001 - the net: see _one_by_one
            return _one_by_one(self.backends, name, jobs, exc)
        if answers:
            self.backends.resume(name)
        if isinstance(answer, _Answered):
            answer.fill_missing(name, jobs)
        return answer


@dataclasses.dataclass
class _Answered:
    """Per-job results of one call, by row id."""

    results: Results

    @classmethod
    def of(cls, jobs: Sequence[models.StagedJob], answered: Sequence[models.PublishResult]) -> _Answered:
        made = cls({})
        made.add(jobs, answered)
        return made

    def add(self, jobs: Sequence[models.StagedJob], answered: Sequence[models.PublishResult]) -> None:
        """Keep the results for these jobs (an adapter's stray result for another row is ignored)."""
        wanted = {job.id for job in jobs}
        self.results.update((result.row_id, result) for result in answered if result.row_id in wanted)

    def fill_missing(self, name: str, jobs: Sequence[models.StagedJob]) -> None:
        """A job the adapter did not answer is a RETRY (it may or may not have been published)."""
        for job in jobs:
            if job.id not in self.results:
                self.results[job.id] = models.PublishResult.retry(job, f"{name}: no result returned")


_UNAVAILABLE = object()


def _refused(job: models.StagedJob) -> models.PublishResult:
    """The ``refuse_first`` failpoint's rejection, logged (a test counts them in the log)."""
    reason = failpoints.REFUSED.format(job.id)
    log.warning(reason, extra={"event": "failpoint_refused", "job_ids": [str(job.job_id)]})
    return models.PublishResult.rejected(job, reason)


def _one_by_one(
    backends: availability.Availability, name: str, jobs: Sequence[models.StagedJob], first: Exception
) -> object:
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
    backends.close(name)
    adapter = backends.adapters[name]
    answered = _Answered({})
    raised: dict[int, Exception] = {}
    for job in jobs:
        try:
            backends.ensure_open(name)
            answered.add([job], adapter.publish_batch([job]))
        except errors.BackendUnavailable as exc:
            backends.fail(name, exc)
            return answered  # the rest stay untouched
        except Exception as exc:  # noqa: BLE001 - this job's rejection (or an outage, below)
            raised[job.id] = exc
            backends.close(name)
    if raised and len(raised) == len(jobs) and not backends.answers_ping(name):
        return _UNAVAILABLE
    answered.fill_missing(name, [job for job in jobs if job.id not in raised])
    for job in jobs:
        if job.id in raised:
            reason = backend.refusal_text(name, raised[job.id], with_type=True)
            answered.results[job.id] = models.PublishResult.rejected(job, reason)
    backends.resume(name)
    return answered
