"""drain.gate.BackendGate over the in-memory backend, no database: how a queue that keeps
refusing its jobs (a full queue nacking with reject-publish) is paced apart from the others."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence

from drain import backend, backoff, errors, failpoints, gate, metrics, models, settlement, testing


def job(row_id: int, queue: str, backend_name: str = "default") -> models.StagedJob:
    now = datetime.datetime.now(datetime.UTC)
    return models.StagedJob(row_id, uuid.uuid4(), "app.t", [], {}, queue, backend_name, {}, now)


def test_a_queue_that_keeps_nacking_waits_longer_each_time_and_others_do_not() -> None:
    memory = testing.MemoryAdapter("default")
    full = {"full"}
    memory.behaviour = lambda j: "retry" if j.queue in full else "ack"
    the_gate = gate.BackendGate(
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
    decided = settlement.decide(jobs, results, max_attempts=lambda _: 3, retry_backoff=rejected_backoff)
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


def test_backends_that_hang_together_cannot_outlive_the_steps_budget_and_a_healthy_one_goes_first() -> None:
    """Eight backends on one dark broker, each hanging its own 2 s: one after the other they held
    a batch's transaction 16 s, past the session's fence (red team 25). A step calls no further
    backend once its budget (1 s here) is used up; the one that answered last time goes first."""
    now = [0.0]
    hanging = {f"cel{n}": _Hanging(now, 2.0) for n in range(8)}
    adapters: dict[str, backend.Adapter] = {**hanging, "events": testing.MemoryAdapter("events")}
    the_gate = gate.BackendGate(
        adapters,
        metrics_=metrics.Metrics(),
        failpoints_=failpoints.Failpoints(),
        clock=lambda: now[0],
        rand=lambda: 0.0,
        step_budget_s=1.0,
    )
    the_gate.begin_step()
    results, _ = the_gate.forward([job(1, "q", "events")], submit=False)
    assert results[1].outcome is models.Outcome.PUBLISHED

    jobs = [job(10 + n, "q", name) for n, name in enumerate([*hanging, "events"])]
    for step in range(4):
        started = now[0]
        the_gate.begin_step()
        paused = set(the_gate.paused())
        results, _ = the_gate.forward([j for j in jobs if j.backend not in paused], submit=False)
        assert now[0] - started <= 1.0 + 2.0, f"step {step} took {now[0] - started} s"
        assert results[jobs[-1].id].outcome is models.Outcome.PUBLISHED  # called first
        assert the_gate.deferred, "the budget deferred the rest"
        assert len(the_gate.failed) == 1
    assert sum(adapter.calls for adapter in hanging.values()) == 4
