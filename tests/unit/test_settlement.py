"""drain.settlement.decide: a batch's per-job results → delete / retry / dead-letter. No database."""

from __future__ import annotations

import dataclasses
import datetime
import uuid

from hypothesis import given
from hypothesis import strategies as st

from drain import backoff, models, settlement

NO_JITTER = backoff.Backoff(1.0, 600.0, rand=lambda: 0.0)


def job(row_id: int, *, attempts: int = 0, backend: str = "b", queue: str = "q") -> models.StagedJob:
    return models.StagedJob(
        id=row_id,
        job_id=uuid.uuid4(),
        job_name="app.t",
        args=(),
        kwargs={},
        queue=queue,
        backend=backend,
        options={},
        created_at=datetime.datetime.now(datetime.UTC),
        attempts=attempts,
    )


def decide(
    jobs: list[models.StagedJob], results: list[models.PublishResult], limit: int = 3
) -> settlement.Settlement:
    return settlement.decide(
        jobs, {r.row_id: r for r in results}, max_attempts=lambda _: limit, retry_backoff=NO_JITTER
    )


def test_each_outcome_becomes_its_action() -> None:
    jobs = [job(1), job(2), job(3, attempts=1), job(4, attempts=2), job(5)]
    results = [
        models.PublishResult.published(jobs[0]),
        models.PublishResult.retry(jobs[1], "nacked"),
        models.PublishResult.rejected(jobs[2], "bad option"),
        models.PublishResult.rejected(jobs[3], "bad option"),
    ]  # job 5 has no result: its backend was unavailable
    decided = decide(jobs, results)
    assert decided.delete == [1]
    assert [(r.row_id, r.counted, r.error) for r in decided.retry] == [(2, 0, "nacked"), (3, 1, "bad option")]
    assert decided.retry[1].delay_s == 1.0  # the second attempt: base × 2^1 × 0.5 (jitter floor)
    assert [(d.job.id, d.attempts, d.error) for d in decided.dead] == [(4, 3, "bad option")]
    assert (decided.retried, decided.rejected) == (1, 2)
    assert decided.outcomes == {("b", "q", "published"): 1, ("b", "q", "retry"): 1, ("b", "q", "rejected"): 2}


def test_max_attempts_is_per_backend_and_errors_are_bounded() -> None:
    jobs = [job(1, backend="strict"), job(2, backend="lenient")]
    results = [models.PublishResult.rejected(j, "x" * 5000) for j in jobs]
    decided = settlement.decide(
        jobs,
        {r.row_id: r for r in results},
        max_attempts=lambda name: 1 if name == "strict" else 10,
        retry_backoff=NO_JITTER,
    )
    assert [d.job.id for d in decided.dead] == [1]
    assert [r.row_id for r in decided.retry] == [2]
    assert len(decided.retry[0].error) == settlement.MAX_ERROR_CHARS


outcomes = st.sampled_from([None, *models.Outcome])


@given(st.lists(st.tuples(outcomes, st.integers(0, 20)), max_size=30), st.integers(1, 10))
def test_every_answered_job_gets_exactly_one_action(
    rows: list[tuple[models.Outcome | None, int]], limit: int
) -> None:
    jobs = [job(i, attempts=attempts) for i, (_, attempts) in enumerate(rows)]
    results = [
        models.PublishResult(j.id, outcome, None if outcome is models.Outcome.PUBLISHED else "why")
        for j, (outcome, _) in zip(jobs, rows, strict=True)
        if outcome is not None
    ]
    decided = decide(jobs, results, limit)
    acted = decided.delete + [r.row_id for r in decided.retry] + [d.job.id for d in decided.dead]
    assert sorted(acted) == sorted(r.row_id for r in results)  # each answered job once, no other
    assert all(0 < r.delay_s <= 600 for r in decided.retry)
    assert all(d.attempts >= limit for d in decided.dead)
    assert sum(decided.outcomes.values()) == len(results)


def test_backoff_is_capped_exponential_with_equal_jitter() -> None:
    low = backoff.Backoff(1.0, 8.0, rand=lambda: 0.0)
    high = backoff.Backoff(1.0, 8.0, rand=lambda: 0.999999)
    assert [low.delay(n) for n in (1, 2, 3, 4, 5, 100_000)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert high.delay(10) < 8.0
    streak = backoff.Streak(low)
    assert [streak.next(), streak.next()] == [0.5, 1.0]
    streak.reset()
    assert streak.next() == 0.5
    assert dataclasses.replace(low, rand=lambda: 0.5).delay(0) == 0.75  # attempt 0 counts as the first
