"""Metric labels stay bounded whatever the rows name (issue 22): real Postgres, an in-process relay.

A row chooses its ``queue`` and its ``backend``. Thousands of distinct queue names, and rows for
thousands of backends nobody configured, go through a leading relay; the registry's series of
every labelled metric stay within the bound (configured backends and ``(other)``; the schedules'
queues, ``MAX_QUEUE_LABELS`` first-seen queues and ``(other)``) and still count every job.
"""

from __future__ import annotations

import psycopg

import drain
from drain import config, testing
from drain.observability import metrics
from tests.conftest import ManualClock
from tests.support import relays

QUEUES = 3000
UNKNOWN_BACKENDS = 1000
OUTCOMES = 3  # published, retry, rejected


def series(registry: object, name: str) -> list[dict[str, str]]:
    return [
        sample.labels
        for family in registry.collect()  # type: ignore[attr-defined]
        for sample in family.samples
        if sample.name == name
    ]


def test_thousands_of_queues_and_unknown_backends_make_a_bounded_number_of_series(
    settings: config.Settings, database: str
) -> None:
    memory = testing.MemoryAdapter("default")
    schedule = config.ScheduleSettings(
        name="nightly", cron="0 3 * * *", job_name="app.nightly", queue="reports"
    )
    leader = relays.leading(
        settings, {"default": memory}, ManualClock(), max_attempts=1, schedules=(schedule,)
    )
    with psycopg.connect(database) as conn:
        drain.stage_many(conn, [drain.Job("app.t", queue=f"topic.{n}") for n in range(QUEUES)])
        drain.stage_many(conn, [drain.Job("app.t", queue="reports") for _ in range(10)])
        drain.stage_many(
            conn, [drain.Job("app.t", queue=f"q{n}", backend=f"b{n}") for n in range(UNKNOWN_BACKENDS)]
        )
    while leader.drain_once().selected:
        pass
    registry = leader.metrics.registry

    jobs = series(registry, "drain_jobs_total")
    backends = {labels["backend"] for labels in jobs}
    queues = {labels["queue"] for labels in jobs}
    assert backends == {"default", metrics.OTHER}
    assert "reports" in queues and metrics.OTHER in queues
    assert len(queues) <= metrics.MAX_QUEUE_LABELS + 2
    assert len(jobs) <= len(backends) * len(queues) * OUTCOMES
    assert len(series(registry, "drain_jobs_dead_lettered_total")) <= len(backends) * len(queues)
    assert len(series(registry, "drain_commit_to_publish_seconds_count")) <= len(backends)
    assert len(memory.published) == QUEUES + 10

    def total(name: str, **labels: str) -> float:
        return sum(
            sample.value
            for family in registry.collect()
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    assert total("drain_jobs_total", outcome="published") == QUEUES + 10
    assert total("drain_jobs_total", outcome="rejected", backend=metrics.OTHER) == UNKNOWN_BACKENDS
    assert total("drain_jobs_dead_lettered_total", backend=metrics.OTHER) == UNKNOWN_BACKENDS
    assert total("drain_jobs_total", queue="reports", outcome="published") == 10


def test_a_label_is_printable_and_short_or_it_is_other() -> None:
    label = metrics.BoundedLabel("queue", ["configured"], spare=2)
    assert label("configured") == "configured"
    assert label("a\nb") == metrics.OTHER
    assert label("x" * (metrics.MAX_LABEL_CHARS + 1)) == metrics.OTHER
    assert label("") == metrics.OTHER
    assert [label("one"), label("two"), label("three"), label("one")] == ["one", "two", metrics.OTHER, "one"]
    assert len(label) == 3
