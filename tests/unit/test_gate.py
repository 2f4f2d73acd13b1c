"""drain.gate.BackendGate over the in-memory backend, no database: how a queue that keeps
refusing its jobs (a full queue nacking with reject-publish) is paced apart from the others."""

from __future__ import annotations

import datetime
import uuid

from drain import backoff, failpoints, gate, metrics, models, settlement, testing


def job(row_id: int, queue: str) -> models.StagedJob:
    now = datetime.datetime.now(datetime.UTC)
    return models.StagedJob(row_id, uuid.uuid4(), "app.t", [], {}, queue, "default", {}, now)


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
