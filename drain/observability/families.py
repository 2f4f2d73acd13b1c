"""The metric families of :class:`drain.observability.metrics.Metrics`, grouped by concern.

Each group registers its families on the process's registry and holds the methods the relay
reports through: what went through (:class:`Throughput`), the loop, its lead and its backends
(:class:`Loop`), settlement (:class:`Settlement`); and the table's figures, exported by the
leader only (:class:`DatabaseFigures`). ``docs/operations/metrics.md`` lists every name.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

BATCH_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_SIZE_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
DELAY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)

CANNOT_SETTLE_REASONS = (
    "recovery",
    "read_only",
    "schema",
    "privileges",
    "select_fails",
    "delete_fails",
    "retry_fails",
    "bury_fails",
    "settlement_failed",
    "lanes",
)
"""The ``reason`` label values of drain_cannot_settle: drain.relay.leadership.REASONS."""


def observe_all(histogram: Histogram, amounts: Collection[float]) -> None:
    """``histogram.observe(amount)`` for each of ``amounts``, with each bucket and the sum
    incremented once: a backlog's batch observes 500 delays, which fall in a bucket or two.

    The counts are those of ``observe``; the sum is the batch's sum added once (the same to the
    rounding of float additions). A prometheus_client whose Histogram lacks the attributes
    read here, or a NaN (no bucket takes it), is observed one amount at a time."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if (
        len(amounts) < 2
        or bounds is None
        or buckets is None
        or total is None
        or any(map(math.isnan, amounts))
    ):
        for amount in amounts:
            histogram.observe(amount)
        return
    counts: dict[int, int] = {}
    for amount in amounts:
        index = bisect.bisect_left(bounds, amount)  # observe's: the first bound >= amount
        counts[index] = counts.get(index, 0) + 1
    total.inc(sum(amounts))
    for index, count in counts.items():
        buckets[index].inc(count)


Label = Callable[[str], str]
"""A label dimension: a value as it may be exported (metrics.BoundedLabel)."""

# name, help, key in the figures mapping (see Store.status)
_DATABASE_GAUGES = (
    ("drain_due_jobs", "Rows due now (run_at null or passed), counted up to the cap; the backlog.", "due"),
    ("drain_scheduled_jobs", "Rows with a future run_at, counted up to the cap.", "future"),
    (
        "drain_oldest_due_age_seconds",
        "Age of the oldest due row (since created_at, or since run_at for a deferred row): the lag.",
        "oldest_due_age_s",
    ),
    ("drain_dead_letter_jobs", "Rows in the dead-letter table, counted up to the cap.", "dead"),
    (
        "drain_blocked_keys",
        "Ordering keys with a due row held back by a lower id of its key (or, with "
        "block_on_dead_letter, a dead letter of it), among the first due rows (KEY_COUNT_CAP a branch).",
        "blocked_keys",
    ),
    (
        "drain_blocked_jobs",
        "Due rows held back by their ordering key, among the first due rows (KEY_COUNT_CAP a "
        "branch; drain_due_jobs counts them too).",
        "blocked",
    ),
    (
        "drain_oldest_blocked_age_seconds",
        "Age of the oldest due row held back by its ordering key (as the lag counts it); 0 without one.",
        "oldest_blocked_age_s",
    ),
    (
        "drain_database_figures_timestamp_seconds",
        "When the leader last read the figures above from the database.",
        "read_at",
    ),
)


# name, help, field of a lane's figures (drain.relay.lanes.LaneFigures), by lane
_LANE_GAUGES = (
    (
        "drain_lane_due_jobs",
        "Each lane's due rows, among the due rows the status counts walk (with lanes; lane 0's leader only).",
        "due",
    ),
    (
        "drain_lane_oldest_due_age_seconds",
        "Age of each lane's oldest due row, as drain_oldest_due_age_seconds counts it (with lanes; "
        "lane 0's leader only).",
        "oldest_due_age_s",
    ),
)


class DatabaseFigures(Collector):
    """The table's figures as gauges, present only while someone set them (the leader); each
    lane's under the key ``lanes`` (a sequence of objects with a ``lane`` and the fields
    _LANE_GAUGES names), when given: at most MAX_LANES series a family."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._figures: dict[str, Any] | None = None

    def set(self, figures: Mapping[str, Any] | None) -> None:
        with self._lock:
            self._figures = None if figures is None else dict(figures)

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(name, text) for name, text, _ in _DATABASE_GAUGES] + [
            GaugeMetricFamily(name, text, labels=["lane"]) for name, text, _ in _LANE_GAUGES
        ]

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            figures = self._figures
        if figures is None:
            return []
        found: list[Metric] = [
            GaugeMetricFamily(name, text, value=float(figures.get(key, 0.0)))
            for name, text, key in _DATABASE_GAUGES
        ]
        lanes = figures.get("lanes")
        if lanes is None:
            return found
        for name, text, field in _LANE_GAUGES:
            family = GaugeMetricFamily(name, text, labels=["lane"])
            for lane in lanes:
                family.add_metric([str(lane.lane)], float(getattr(lane, field)))
            found.append(family)
        return found


class Throughput:
    """What went through: jobs by backend, queue and outcome; dead letters; batches; the delay."""

    backend_label: Label
    queue_label: Label
    queue_refusing: Gauge

    def _register_throughput(self, r: CollectorRegistry) -> None:
        self._queues_seen: set[tuple[str, str]] = set()
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
        self.batches = Counter("drain_batches", "Batches that read at least one row.", registry=r)
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
            "From staging (created_at, the database clock) to the broker's acknowledgement.",
            ["backend"],
            buckets=DELAY_BUCKETS,
            registry=r,
        )

    def observe_batch(self, duration_s: float, size: int) -> None:
        self.batches.inc()
        self.batch_duration.observe(duration_s)
        self.batch_size.observe(size)

    def count_jobs(self, backend: str, queue: str, outcome: str, count: int = 1) -> None:
        labels = (self.backend_label(backend), self.queue_label(queue))
        self.jobs.labels(*labels, outcome).inc(count)
        if outcome == "published" and labels not in self._queues_seen:
            self._queues_seen.add(labels)  # a queue that takes jobs shows drain_queue_refusing 0
            self.queue_refusing.labels(*labels).set(0)

    def count_dead(self, backend: str, queue: str, count: int = 1) -> None:
        self.dead_lettered.labels(self.backend_label(backend), self.queue_label(queue)).inc(count)

    def observe_delays(self, backend: str, delays_s: Iterable[float]) -> None:
        """Each published job's commit-to-publish delay, on ``backend``'s histogram (labelled once)."""
        histogram = self.delay.labels(self.backend_label(backend))
        observe_all(histogram, [max(seconds, 0.0) for seconds in delays_s])


class Loop:
    """The relay loop: whether it leads, its backends (up, in flight, deferred), its tick, its
    wake-up. Losing the lead withdraws the table's figures (:class:`DatabaseFigures`)."""

    backend_label: Label
    queue_label: Label
    _figures: DatabaseFigures
    _queues_seen: set[tuple[str, str]]

    def _register_loop(self, r: CollectorRegistry, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._last_tick = clock()
        self._leading = False
        self.leader = Gauge(
            "drain_leader",
            "1 while this process leads: the table's leader lock, or with lanes at least one lane.",
            registry=r,
        )
        self._lane_count = 1
        self.lanes = Gauge(
            "drain_lanes", "The lane count this drain runs with (the setting lanes; 1: no lanes).", registry=r
        )
        self.lanes.set(1)
        self.lanes_led = Gauge(
            "drain_lanes_led",
            "How many lanes this drain leads (with lanes = 1: 1 while it leads the table).",
            registry=r,
        )
        self.lane_led = Gauge(
            "drain_lane_led",
            "1 while this drain leads the lane, 0 while another or none does; one series per lane "
            "of its count (at most MAX_LANES; with lanes = 1, lane 0 is the whole table).",
            ["lane"],
            registry=r,
        )
        self.lane_led.labels("0").set(0)
        self.lanes_indexed = Gauge(
            "drain_lanes_indexed",
            "1 while this drain (with lanes > 1) finds the lanes index of its count serving: its "
            "selects read its own lanes through it while it leads k of N lanes with k x k <= 2 N; 0: it "
            "walks every lane's due rows (run drain migrate with its lanes setting; its log says why).",
            registry=r,
        )
        self.leader_changes = Counter(
            "drain_leader_changes", "Times this process gained or lost leadership.", registry=r
        )
        self.backend_up = Gauge(
            "drain_backend_up",
            "1 when the backend accepted the last attempt, 0 while it is unavailable.",
            ["backend"],
            registry=r,
        )
        self.queue_refusing = Gauge(
            "drain_queue_refusing",
            "1 while every job of the queue came back unpublished in its backend's last call "
            "(no route, a full queue, its key of the wrong type): its rows wait, uncounted.",
            ["backend", "queue"],
            registry=r,
        )
        self.in_flight = Gauge(
            "drain_jobs_in_flight",
            "Jobs submitted to a pipelined backend whose acknowledgements are not settled yet.",
            registry=r,
        )
        self.last_tick = Gauge(
            "drain_loop_last_tick_timestamp_seconds", "When the relay loop last went round.", registry=r
        )
        self.wakeup_missed = Counter(
            "drain_wakeup_missed",
            "Idle sleeps that ended on the poll with a job staged for now and no notification "
            "(the drain_wake trigger is missing or disabled, or a producer skips triggers).",
            registry=r,
        )
        self.wakeup_armed = Gauge(
            "drain_wakeup_armed",
            "1 while the idle leader sleeps armed: a producer's commit wakes it (wakeup = notify).",
            registry=r,
        )
        self.deferred = Counter(
            "drain_backend_deferred",
            "Steps in which a backend was not called because the step had used half its publish "
            "timeout on other backends: its rows waited, untouched, for a later step.",
            ["backend"],
            registry=r,
        )

    def set_leader(self, leading: bool) -> None:
        """Record the role; losing the lead also withdraws the database-derived gauges."""
        if self._leading != leading:
            self.leader_changes.inc()
        self._leading = leading
        self.leader.set(1 if leading else 0)
        if self._lane_count == 1:
            self.lanes_led.set(1 if leading else 0)
            self.lane_led.labels("0").set(1 if leading else 0)
        if not leading:
            self._figures.set(None)

    def set_lanes_indexed(self, indexed: bool) -> None:
        """Whether the lanes index of this drain's count serves (drain.relay.lanes)."""
        self.lanes_indexed.set(1 if indexed else 0)

    def set_lanes(self, count: int, led: Collection[int]) -> None:
        """The lane count this drain runs with and the lanes it leads (drain.relay.lanes): a
        ``drain_lane_led`` series for each lane of the count."""
        self._lane_count = count
        self.lanes.set(count)
        self.lanes_led.set(len(led))
        for lane in range(count):
            self.lane_led.labels(str(lane)).set(1 if lane in led else 0)

    def set_figures(self, figures: Mapping[str, Any] | None) -> None:
        """Export the table's figures (keys of ``Store.status``, and each lane's under ``lanes``:
        DatabaseFigures); None withdraws them."""
        self._figures.set(figures)

    def set_in_flight(self, jobs: int) -> None:
        self.in_flight.set(jobs)

    def set_backend_up(self, backend: str, up: bool) -> None:
        self.backend_up.labels(self.backend_label(backend)).set(1 if up else 0)

    def set_queue_refusing(self, backend: str, queue: str, refusing: bool) -> None:
        labels = (self.backend_label(backend), self.queue_label(queue))
        self._queues_seen.add(labels)
        self.queue_refusing.labels(*labels).set(1 if refusing else 0)

    def count_deferred(self, backend: str) -> None:
        self.deferred.labels(self.backend_label(backend)).inc()

    def set_wakeup_armed(self, armed: bool) -> None:
        self.wakeup_armed.set(1 if armed else 0)

    def count_wakeup_missed(self) -> None:
        self.wakeup_missed.inc()

    def tick(self) -> None:
        """The relay loop went round: /healthz is healthy while this keeps being called."""
        self._last_tick = self._clock()
        self.last_tick.set(time.time())

    def seconds_since_tick(self) -> float:
        return self._clock() - self._last_tick


class Settlement:
    """Settlement: whether this drain can settle here and why not, what is unsettled, the
    failures, the rows parked."""

    def _register_settlement(self, r: CollectorRegistry) -> None:
        self.cannot_settle = Gauge(
            "drain_cannot_settle",
            "1 while this drain cannot settle (delete what it publishes) where it is connected, "
            "by reason: recovery (a standby server), read_only, privileges, select_fails (the probe's "
            "own row is hidden from its SELECT), delete_fails, retry_fails, bury_fails (the probe's "
            "test write of that kind failed), settlement_failed. "
            "It publishes nothing meanwhile.",
            ["reason"],
            registry=r,
        )
        for reason in CANNOT_SETTLE_REASONS:  # every series present from the start, at 0
            self.cannot_settle.labels(reason).set(0)
        self._cannot_settle_reason: str | None = None
        self.unsettled = Gauge(
            "drain_unsettled_jobs",
            "Jobs handed to their backend whose settlement (the DELETE) is not written yet: it "
            "failed, the table refused it and the row's parking, or an app holds the row; excluded "
            "from selection until written.",
            registry=r,
        )
        self.settlement_failures = Counter(
            "drain_settlement_failures",
            "Steps whose settlement of published jobs could not be written.",
            registry=r,
        )
        self.parked = Counter(
            "drain_parked_jobs",
            "Rows whose settlement the table refused (their DELETE or burial: a foreign key to the "
            "job_id, a trigger), parked with run_at in the year 9000 and why in last_error; the "
            "rest of their batch was settled. `drain status` counts those still parked.",
            registry=r,
        )

    def set_cannot_settle(self, reason: str | None) -> None:
        """The reason this drain cannot settle now (None: it can); the previous reason goes to 0."""
        if reason == self._cannot_settle_reason:
            return
        if self._cannot_settle_reason is not None:
            self.cannot_settle.labels(self._cannot_settle_reason).set(0)
        if reason is not None:
            self.cannot_settle.labels(reason).set(1)
        self._cannot_settle_reason = reason

    def set_unsettled(self, jobs: int) -> None:
        self.unsettled.set(jobs)

    def count_settlement_failure(self) -> None:
        self.settlement_failures.inc()

    def count_parked(self, rows: int) -> None:
        self.parked.inc(rows)
