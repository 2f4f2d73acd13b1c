"""drain.relay.forward.Forwarder over the in-memory backend, no database: how a queue that keeps
refusing its jobs (a full queue nacking with reject-publish) is paced apart from the others."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence

from drain import backend, errors, models, testing
from drain.observability import metrics
from drain.relay import backoff, failpoints, forward, settle


def job(row_id: int, queue: str, backend_name: str = "default") -> models.StagedJob:
    now = datetime.datetime.now(datetime.UTC)
    return models.StagedJob(row_id, uuid.uuid4(), "app.t", [], {}, queue, backend_name, {}, now)


def test_a_queue_that_keeps_nacking_waits_longer_each_time_and_others_do_not() -> None:
    memory = testing.MemoryAdapter("default")
    full = {"full"}
    memory.behaviour = lambda j: "retry" if j.queue in full else "ack"
    the_gate = forward.Forwarder(
        {"default": memory},
        metrics_=metrics.Metrics(),
        failpoints_=failpoints.Failpoints(),
        clock=lambda: 0.0,
        rand=lambda: 0.0,  # the jitter floor: delays are exactly half the backoff
    )

    def one_batch(first_id: int) -> tuple[dict[int, models.PublishResult], list[models.StagedJob]]:
        jobs = [job(first_id + n, "full" if n % 2 else "open") for n in range(4)]
        results, _ = the_gate.forward(jobs, submit=False)
        return results, jobs

    waits = []
    for step in range(6):
        results, jobs = one_batch(step * 10)
        outcomes = {j.queue: results[j.id].outcome for j in jobs}
        assert outcomes == {"open": models.Outcome.PUBLISHED, "full": models.Outcome.RETRY}
        (wait,) = {results[j.id].retry_after_s for j in jobs if j.queue == "full"}
        assert all(results[j.id].retry_after_s is None for j in jobs if j.queue == "open")
        waits.append(wait)
    assert waits == [1.0, 2.0, 4.0, 8.0, 15.0, 15.0]  # doubling to the cap (30 s x the jitter floor)

    rejected_backoff = backoff.Backoff(1.0, 600.0, rand=lambda: 0.0)
    decided = settle.decide(jobs, results, max_attempts=lambda _: 3, retry_backoff=rejected_backoff)
    assert {(r.counted, r.delay_s) for r in decided.retry} == {(0, 15.0)}  # no attempt counted
    assert not decided.dead

    full.clear()  # the queue has room again: one publish ends its streak
    results, jobs = one_batch(100)
    assert all(r.outcome is models.Outcome.PUBLISHED for r in results.values())
    full.add("full")
    results, jobs = one_batch(200)
    assert {results[j.id].retry_after_s for j in jobs if j.queue == "full"} == {1.0}


class _Hanging:
    """A backend whose every call hangs ``hang_s`` (on the test's clock), then is unavailable."""

    def __init__(self, clock: list[float], hang_s: float) -> None:
        self.clock, self.hang_s, self.calls = clock, hang_s, 0

    def open(self) -> None:
        pass

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        self.calls += 1
        self.clock[0] += self.hang_s
        raise errors.BackendUnavailable("timed out")

    def ping(self) -> None:
        raise errors.BackendUnavailable("timed out")

    def close(self) -> None:
        pass


def _gate(adapters: dict[str, backend.Adapter], now: list[float], budget_s: float) -> forward.Forwarder:
    return forward.Forwarder(
        adapters,
        metrics_=metrics.Metrics(),
        failpoints_=failpoints.Failpoints(),
        clock=lambda: now[0],
        rand=lambda: 0.0,
        step_budget_s=budget_s,
    )


def _step(the_gate: forward.Forwarder, jobs: list[models.StagedJob]) -> dict[int, models.PublishResult]:
    """One step as the relay takes it: the rows of paused backends are not selected."""
    the_gate.begin_step()
    paused = set(the_gate.paused())
    results, _ = the_gate.forward([j for j in jobs if j.backend not in paused], submit=False)
    return results


def test_backends_that_hang_together_cannot_outlive_the_steps_budget() -> None:
    """Eight backends on one dark broker, each hanging its own 2 s: one after the other they held
    a batch's transaction 16 s, past the session's fence (red team 25). A step calls no further
    backend once its budget (1 s here) is used up; the healthy one still goes, within a sweep."""
    now = [0.0]
    hanging = {f"cel{n}": _Hanging(now, 2.0) for n in range(8)}
    the_gate = _gate({**hanging, "events": testing.MemoryAdapter("events")}, now, 1.0)
    jobs = [job(10 + n, "q", name) for n, name in enumerate([*hanging, "events"])]
    published_at = []
    for step in range(12):
        started = now[0]
        results = _step(the_gate, jobs)
        assert now[0] - started <= 1.0 + 2.0, f"step {step} took {now[0] - started} s"
        assert len(the_gate.failed) <= 1
        if jobs[-1].id in results and results[jobs[-1].id].outcome is models.Outcome.PUBLISHED:
            published_at.append(step)
    assert published_at and published_at[0] <= len(hanging), published_at
    (family,) = the_gate._metrics.deferred.collect()
    deferred = sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    assert deferred >= 1, "a step that deferred a backend is counted"
    assert sum(adapter.calls for adapter in hanging.values()) <= 12


class _Slow(testing.MemoryAdapter):
    """A healthy backend that takes ``answer_s`` (on the test's clock) over every batch."""

    def __init__(self, name: str, clock: list[float], answer_s: float) -> None:
        super().__init__(name)
        self.clock, self.answer_s = clock, answer_s

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        self.clock[0] += self.answer_s
        return list(super().publish_batch(jobs))


def test_a_slow_healthy_backend_cannot_keep_another_waiting_for_ever() -> None:
    """One backend answering each batch in 0.6 s, over a budget of 0.5 s, went first every step
    because it answered last time, and the other was deferred every time (red team 27): the
    least recently called goes first."""
    now = [0.0]
    other = testing.MemoryAdapter("other")
    the_gate = _gate({"slow": _Slow("slow", now, 0.6), "other": other}, now, 0.5)
    for step in range(3):
        _step(the_gate, [job(100 + 2 * step, "q", "slow"), job(101 + 2 * step, "q", "other")])
    assert len(other.published) >= 1


def test_a_backend_that_recovered_from_a_pause_is_not_kept_waiting_by_a_slow_one() -> None:
    """Red team 28: a backend with a pause streak was ordered after every backend without one; a
    slow healthy one used the budget each step, so the recovered one was deferred, never called,
    and never cleared its streak: for ever."""
    now = [0.0]
    down = [True]

    class _Recovering(testing.MemoryAdapter):
        def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
            if down[0]:
                down[0] = False
                raise errors.BackendUnavailable("down once")
            return list(super().publish_batch(jobs))

    recovered = _Recovering("recovered")
    the_gate = _gate({"slow": _Slow("slow", now, 0.6), "recovered": recovered}, now, 0.5)
    for step in range(20):
        now[0] += 1.0  # past any pause
        _step(the_gate, [job(1000 + 2 * step, "q", "recovered"), job(1001 + 2 * step, "q", "slow")])
    assert len(recovered.published) >= 5


def test_rows_for_an_unknown_backend_do_not_take_the_first_call_of_every_step() -> None:
    """Red team 29: a slow select used half the budget before any call, and rows naming a backend
    the config lacks (never called, so always ordered first) took the one call the budget still
    allowed: the real backend was deferred in every step."""
    now = [0.0]
    real = testing.MemoryAdapter("real")

    class _SlowSelect(forward.Forwarder):
        def begin_step(self) -> None:
            super().begin_step()
            now[0] += 0.6  # the select, between begin_step and forward

    the_gate = _SlowSelect(
        {"real": real},
        metrics_=metrics.Metrics(),
        failpoints_=failpoints.Failpoints(),
        clock=lambda: now[0],
        rand=lambda: 0.0,
        step_budget_s=0.5,
    )
    for step in range(5):
        results = _step(the_gate, [job(10 * step, "q", "gone"), job(10 * step + 1, "q", "real")])
        assert results[10 * step].outcome is models.Outcome.REJECTED
    assert len(real.published) == 5


def _memory_gate(memory: testing.MemoryAdapter, metrics_: metrics.Metrics) -> forward.Forwarder:
    return forward.Forwarder(
        {"default": memory},
        metrics_=metrics_,
        failpoints_=failpoints.Failpoints(),
        clock=lambda: 0.0,
        rand=lambda: 0.0,
    )


def test_a_refusing_queue_is_said_by_the_gauge_until_it_accepts_again() -> None:
    memory = testing.MemoryAdapter("default")
    full = {"full"}
    memory.behaviour = lambda j: "retry" if j.queue in full else "ack"
    the_metrics = metrics.Metrics(backends=["default"], queues=["full", "open"])
    the_gate = _memory_gate(memory, the_metrics)

    def refusing() -> float | None:
        return the_metrics.registry.get_sample_value(
            "drain_queue_refusing", {"backend": "default", "queue": "full"}
        )

    the_gate.forward([job(1, "full"), job(2, "open")], submit=False)
    assert refusing() == 1.0
    full.clear()
    the_gate.forward([job(3, "full")], submit=False)
    assert refusing() == 0.0


def test_every_job_of_a_call_unpublished_across_queues_is_an_outage_not_the_queues() -> None:
    """Issue 33: what every queue of a call refuses is the backend's: the rows get no result
    (untouched, no attempt counted) and the backend is paused, drain_backend_up 0."""
    memory = testing.MemoryAdapter("default")
    memory.behaviour = lambda j: "retry"
    the_metrics = metrics.Metrics(backends=["default"])
    the_gate = _memory_gate(memory, the_metrics)
    results, _ = the_gate.forward([job(1, "a"), job(2, "b"), job(3, "a")], submit=False)
    assert results == {}
    assert the_gate.failed == {"default"} and the_gate.pause_streak("default") == 1
    assert the_metrics.registry.get_sample_value("drain_backend_up", {"backend": "default"}) == 0.0

    the_gate.begin_step()  # one queue alone refusing is that queue's: paced, not an outage
    results, _ = the_gate.forward([job(4, "a"), job(5, "a")], submit=False)
    assert {r.outcome for r in results.values()} == {models.Outcome.RETRY}
    assert the_gate.failed == set()
