"""Prometheus metrics of one drain process, on a registry it owns.

The relay reports what happened through the methods below; nothing here touches the database
or a broker. Labels are bounded: backend, queue and outcome, never ids or arguments.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

BATCH_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_SIZE_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
DELAY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)


class Metrics:
    """Every metric the drain exports; one instance per process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.jobs = Counter(
            "drain_jobs",
            "Jobs handed to a backend, by outcome (published, retry, rejected).",
            ["backend", "queue", "outcome"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "drain_jobs_dead_lettered",
            "Jobs moved to the dead-letter table.",
            ["backend", "queue"],
            registry=r,
        )
        self.batches = Counter("drain_batches", "Batches run by the leader.", registry=r)
        self.batch_duration = Histogram(
            "drain_batch_duration_seconds",
            "Time from BEGIN to COMMIT of one batch.",
            buckets=BATCH_DURATION_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "drain_batch_size_jobs",
            "Rows read per batch.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.delay = Histogram(
            "drain_commit_to_publish_seconds",
            "From staging (created_at) to the broker's acknowledgement.",
            ["backend"],
            buckets=DELAY_BUCKETS,
            registry=r,
        )
        self._leading = False
        self.leader = Gauge("drain_leader", "1 while this process holds the leader lock.", registry=r)
        self.leader_changes = Counter(
            "drain_leader_changes", "Times this process gained or lost leadership.", registry=r
        )
        self.backend_up = Gauge(
            "drain_backend_up",
            "1 when the backend accepted the last attempt, 0 while it is unavailable.",
            ["backend"],
            registry=r,
        )
        self.last_tick = Gauge(
            "drain_loop_last_tick_timestamp_seconds", "When the relay loop last went round.", registry=r
        )

    def observe_batch(self, duration_s: float, size: int) -> None:
        self.batches.inc()
        self.batch_duration.observe(duration_s)
        self.batch_size.observe(size)

    def count_jobs(self, backend: str, queue: str, outcome: str, count: int = 1) -> None:
        self.jobs.labels(backend, queue, outcome).inc(count)

    def count_dead(self, backend: str, queue: str, count: int = 1) -> None:
        self.dead_lettered.labels(backend, queue).inc(count)

    def observe_delay(self, backend: str, seconds: float) -> None:
        self.delay.labels(backend).observe(max(seconds, 0.0))

    def set_leader(self, leading: bool) -> None:
        if self._leading != leading:
            self.leader_changes.inc()
        self._leading = leading
        self.leader.set(1 if leading else 0)

    def set_backend_up(self, backend: str, up: bool) -> None:
        self.backend_up.labels(backend).set(1 if up else 0)

    def tick(self) -> None:
        self.last_tick.set(time.time())
