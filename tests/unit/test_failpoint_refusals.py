"""The ``refuse_first=every:N`` failpoint: deterministic refusals for the end-to-end tests. The
first attempt of every row whose id is a multiple of N is REJECTED before any backend sees it
(an attempt counted, as a backend's refusal); its next attempt goes through."""

from __future__ import annotations

import dataclasses
import datetime
import uuid

import pytest

from drain import errors, models, testing
from drain.observability import metrics
from drain.relay import failpoints, forward


def job(row_id: int, attempts: int = 0) -> models.StagedJob:
    now = datetime.datetime.now(datetime.UTC)
    return models.StagedJob(row_id, uuid.uuid4(), "app.t", [], {}, "q", "default", {}, now, attempts)


def gate(spec: str, memory: testing.MemoryAdapter) -> forward.Forwarder:
    return forward.Forwarder(
        {"default": memory},
        metrics_=metrics.Metrics(),
        failpoints_=failpoints.Failpoints(spec),
        clock=lambda: 0.0,
        rand=lambda: 0.0,
    )


def test_the_first_attempt_of_every_nth_row_is_rejected_and_the_next_goes_through() -> None:
    memory = testing.MemoryAdapter("default")
    the_gate = gate("refuse_first=every:5", memory)
    jobs = [job(row_id) for row_id in range(1, 12)]
    results, _ = the_gate.forward(jobs, submit=False)
    rejected = {row_id for row_id, result in results.items() if result.outcome is models.Outcome.REJECTED}
    assert rejected == {5, 10}
    assert results[5].error == "failpoint refuse_first: the first attempt of row 5 refused"
    assert sorted(j.id for j in memory.published) == [1, 2, 3, 4, 6, 7, 8, 9, 11]

    again, _ = the_gate.forward([dataclasses.replace(jobs[4], attempts=1)], submit=False)
    assert again[5].outcome is models.Outcome.PUBLISHED


def test_unarmed_nothing_is_refused() -> None:
    memory = testing.MemoryAdapter("default")
    results, _ = gate("", memory).forward([job(5), job(10)], submit=False)
    assert {result.outcome for result in results.values()} == {models.Outcome.PUBLISHED}


@pytest.mark.parametrize("spec", ["refuse_first=exit", "refuse_first=every:0", "refuse_first=every:x"])
def test_refuse_first_takes_every_n_only(spec: str) -> None:
    with pytest.raises(errors.ConfigError, match="refuse_first takes every:N"):
        failpoints.Failpoints(spec)
