"""What a step did, counted and logged: its report, the metrics of what it settled, a line per
dead letter, and at DEBUG a line per (backend, queue) published to and the step's totals."""

from __future__ import annotations

import dataclasses
import logging
import time

from drain import models
from drain.observability import logs, metrics
from drain.relay import settle
from drain.store import writes

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BatchReport:
    """What one step (drain_once, drain_step, settle_in_flight) did."""

    selected: int = 0
    published: int = 0
    retried: int = 0
    rejected: int = 0
    dead: int = 0
    skipped: int = 0
    collected: int = 0
    """Jobs of batches in flight (submitted by earlier steps) this step collected and settled."""
    full: bool = False
    again: bool = False
    """The select met a row changed since the step's snapshot (40001), before anything was
    published: look again at once."""

    def add(self, other: BatchReport) -> None:
        """Add another step's counts to these (``drain run --once`` reports the totals)."""
        for field in ("selected", "published", "retried", "rejected", "dead", "skipped"):
            setattr(self, field, getattr(self, field) + getattr(other, field))


def record(
    metrics_: metrics.Metrics,
    decided: settle.Settlement,
    report: BatchReport,
    duration_s: float,
    *,
    in_flight: int,
    unsettled: int,
) -> None:
    """Fill ``report`` with what a step settled, count it and log it. A dead row whose burial the
    table refused (parked or held) is no dead letter."""
    metrics_.set_in_flight(in_flight)
    metrics_.set_unsettled(unsettled)
    refused = decided.refused_ids()
    buried = [dead for dead in decided.dead if dead.job.id not in refused]
    report.published, report.dead = len(decided.published), len(buried)
    report.retried, report.rejected = decided.retried, decided.rejected
    for (backend_name, queue, outcome), count in decided.outcomes.items():
        metrics_.count_jobs(backend_name, queue, outcome, count)
    now = time.monotonic()
    delays: dict[str, list[float]] = {}
    for job in decided.published:
        delays.setdefault(job.backend, []).append(job.age_s + (now - job.read_at))
    for backend_name, delays_s in delays.items():
        metrics_.observe_delays(backend_name, delays_s)
    for dead in buried:
        metrics_.count_dead(dead.job.backend, dead.job.queue)
        _dead_lettered(dead)
    metrics_.observe_batch(duration_s, report.selected)
    if log.isEnabledFor(logging.DEBUG):
        _log_batch(decided, report, duration_s, in_flight)


def _dead_lettered(dead: writes.Dead) -> None:
    log.warning(
        "job %s (%s) dead-lettered after %d attempts: %s",
        dead.job.job_id,
        dead.job.job_name,
        dead.attempts,
        dead.error,
        extra={
            "event": "dead_lettered",
            "backend": dead.job.backend,
            "queue": dead.job.queue,
            "job_ids": [str(dead.job.job_id)],
            "job_name": dead.job.job_name,
            "attempts": dead.attempts,
            "reason": dead.error,
        },
    )


def _log_batch(decided: settle.Settlement, report: BatchReport, duration_s: float, in_flight: int) -> None:
    """DEBUG: one line per (backend, queue) the step published to, then the step's totals."""
    groups: dict[tuple[str, str], list[models.StagedJob]] = {}
    for job in decided.published:
        groups.setdefault((job.backend, job.queue), []).append(job)
    for (backend_name, queue), jobs in groups.items():
        log.debug(
            "backend %s: %d jobs published to queue %s",
            backend_name,
            len(jobs),
            queue,
            extra={
                "event": "published",
                "backend": backend_name,
                "queue": queue,
                "batch_size": len(jobs),
                "job_ids": logs.job_ids(jobs),
            },
        )
    log.debug(
        "batch of %d: %d published, %d retried, %d rejected, %d dead-lettered, %d skipped in %.3fs",
        report.selected,
        report.published,
        report.retried,
        report.rejected,
        report.dead,
        report.skipped,
        duration_s,
        extra={
            "event": "batch",
            "batch_size": report.selected,
            "published": report.published,
            "retried": report.retried,
            "rejected": report.rejected,
            "dead": report.dead,
            "skipped": report.skipped,
            "in_flight": in_flight,
            "duration_s": round(duration_s, 6),
        },
    )
