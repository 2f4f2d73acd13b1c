"""drain.relay.settle.decide: a batch's per-job results → delete / retry / dead-letter. No database."""

from __future__ import annotations

import dataclasses
import datetime
import tracemalloc
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drain import models
from drain.relay import backoff, leadership, settle

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
) -> settle.Settlement:
    return settle.decide(
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
    assert [j.id for j in decided.published] == [1]
    assert [(r.row_id, r.counted, r.error) for r in decided.retry] == [(2, 0, "nacked"), (3, 1, "bad option")]
    assert decided.retry[1].delay_s == 1.0  # the second attempt: base × 2^1 × 0.5 (jitter floor)
    assert [(d.job.id, d.attempts, d.error) for d in decided.dead] == [(4, 3, "bad option")]
    assert (decided.retried, decided.rejected) == (1, 2)
    assert decided.outcomes == {("b", "q", "published"): 1, ("b", "q", "retry"): 1, ("b", "q", "rejected"): 2}


def test_max_attempts_is_per_backend_and_errors_are_bounded() -> None:
    jobs = [job(1, backend="strict"), job(2, backend="lenient")]
    results = [models.PublishResult.rejected(j, "x" * 5000) for j in jobs]
    decided = settle.decide(
        jobs,
        {r.row_id: r for r in results},
        max_attempts=lambda name: 1 if name == "strict" else 10,
        retry_backoff=NO_JITTER,
    )
    assert [d.job.id for d in decided.dead] == [1]
    assert [r.row_id for r in decided.retry] == [2]
    assert len(decided.retry[0].error) == settle.MAX_ERROR_CHARS


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
    acted = (
        [j.id for j in decided.published]
        + [r.row_id for r in decided.retry]
        + [d.job.id for d in decided.dead]
    )
    assert sorted(acted) == sorted(r.row_id for r in results)  # each answered job once, no other
    assert all(0 < r.delay_s <= 600 for r in decided.retry)
    assert all(d.attempts >= limit for d in decided.dead)
    assert sum(decided.outcomes.values()) == len(results)


def test_backoff_is_capped_exponential_with_equal_jitter() -> None:
    low = backoff.Backoff(1.0, 8.0, rand=lambda: 0.0)
    high = backoff.Backoff(1.0, 8.0, rand=lambda: 0.999999)
    assert [low.delay(n) for n in (1, 2, 3, 4, 5, 100_000)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert high.delay(10) < 8.0
    streak = dataclasses.replace(low)
    assert [streak.next(), streak.next()] == [0.5, 1.0]
    streak.reset()
    assert streak.next() == 0.5
    assert dataclasses.replace(low, rand=lambda: 0.5).delay(0) == 0.75  # attempt 0 counts as the first


def test_every_reason_a_drain_cannot_settle_has_its_series_from_the_start() -> None:
    from prometheus_client import generate_latest

    from drain.observability import metrics
    from drain.relay import leadership

    assert set(metrics.CANNOT_SETTLE_REASONS) == set(leadership.REASONS)
    exported = generate_latest(metrics.Metrics().registry).decode()
    for reason in leadership.REASONS:
        assert f'drain_cannot_settle{{reason="{reason}"}} 0.0' in exported


def test_a_refused_row_is_held_with_a_backoff_of_its_own_and_the_rest_forgotten() -> None:

    now = [0.0]
    unsettled = settle.Held(clock=lambda: now[0], rand=lambda: 0.0)
    jobs = [job(1), job(2), job(3)]
    results = {j.id: models.PublishResult.published(j) for j in jobs}
    unsettled.keep(jobs, results)
    taken, _ = unsettled.pending()
    first = unsettled.settled(taken, [jobs[2]], [jobs[1]], results)  # 1 written, 2 refused, 3 held by an app
    assert first == [jobs[1]] and sorted(unsettled.row_ids()) == [2, 3] and not unsettled.failing
    assert unsettled.refused_ids() == {2}
    assert [j.id for j in unsettled.pending()[0]] == [3]  # the refused row waits for its backoff
    now[0] = settle.RETRY_MIN_S
    taken, _ = unsettled.pending()
    assert sorted(j.id for j in taken) == [2, 3]
    assert unsettled.settled(taken, [], [jobs[1]], results) == []  # refused again: not new
    assert unsettled.row_ids() == [2]
    now[0] += settle.REFUSED_MAX_S
    taken, _ = unsettled.pending()
    unsettled.settled(taken, [], [], results)  # written at last
    assert unsettled.row_ids() == [] and unsettled.refused_ids() == set() and not unsettled


def check_row(**changes: object) -> dict[str, object]:
    """A Store.settle_check row of a session that can settle, with ``changes``."""
    row: dict[str, object] = {
        "in_recovery": False,
        "read_only": False,
        "role": "drain",
        "table": '"public"."staged_jobs"',
        "dead": '"public"."staged_jobs_dead"',
        "versions": '"public"."staged_jobs_versions"',
        "table_missing": [],
        "dead_missing": [],
        "versions_missing": [],
        "schema_version": 2,
        "latest_version": 2,
    }
    row.update(changes)
    return row


def test_an_older_schema_blocks_the_lead_without_a_time_bound() -> None:
    assert leadership.blockers(check_row()) == []
    (older,) = leadership.blockers(check_row(schema_version=1))
    assert older.reason == leadership.SCHEMA and older.unbounded
    assert older.detail == (
        '"public"."staged_jobs" is at schema version 1, this drain expects 2: run `drain migrate`'
    )
    assert leadership.blockers(check_row(schema_version=0)) == []  # no table: the relay says so
    assert leadership.blockers(check_row(schema_version=3)) == []  # newer: `drain check` warns
    (recovery,) = leadership.blockers(check_row(schema_version=1, in_recovery=True))
    assert recovery.reason == leadership.RECOVERY
    (unread,) = leadership.blockers(check_row(schema_version=None, versions_missing=["SELECT"]))
    assert unread.reason == leadership.PRIVILEGES and not unread.unbounded
    assert 'SELECT on "public"."staged_jobs_versions"' in unread.detail


def test_a_held_row_keeps_no_content_and_the_rows_held_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a held row costs is bounded whatever the row held: its content is dropped, and past
    MAX_HELD_ROWS (or MAX_HELD_BYTES) the process holds no more (red team 26, finding 4)."""
    monkeypatch.setattr(settle, "MAX_HELD_ROWS", 1_000)
    unsettled = settle.Held(clock=lambda: 0.0, rand=lambda: 0.0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for row_id in range(1_000):
            fat = dataclasses.replace(
                job(row_id), args=["x" * 40_000], kwargs={"k": "v" * 1_000}, options={"o": 1}
            )
            result = models.PublishResult.rejected(fat, "e" * 300)
            assert not unsettled.crowded()
            unsettled.settled([], [], [fat], {row_id: result})
            del fat, result
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert unsettled.crowded() and unsettled.jobs == 1_000
    assert all(not j.args and not j.kwargs and not j.options for j in unsettled.all())
    assert retained - 350 * 1_000 <= settle.HELD_ROW_BYTES * 1_000, retained  # 41 MB unslimmed
    assert retained <= unsettled.bytes  # the estimate bounds what is held

    monkeypatch.setattr(settle, "MAX_HELD_BYTES", 10 * settle.HELD_ROW_BYTES)
    few = settle.Held(clock=lambda: 0.0, rand=lambda: 0.0)
    rows = [job(row_id) for row_id in range(10)]
    few.settled([], [], rows, {j.id: models.PublishResult.published(j) for j in rows})
    assert few.crowded() and few.crowded_out() > 0 and few.failing and few.over_cap
    few.settled([], [], [], {})
    assert not few.failing and not few.over_cap
    long = job(99)
    few.keep([long], {99: models.PublishResult.rejected(long, "e" * 10_000)})
    _, results = few.pending()
    assert len(results[99].error or "") == settle.MAX_ERROR_CHARS  # what a settlement writes
