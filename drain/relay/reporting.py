"""What a step did, counted and logged: its report, the metrics of what it settled, a line per
dead letter and per row the table refused (parked, or held for the first time), and at DEBUG a
line per (backend, queue) published to and the step's totals."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

from drain import models
from drain.observability import logs, metrics
from drain.relay import settlement

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


class StepReporter:
    """Counts and logs what each step settled."""

    def __init__(self, metrics_: metrics.Metrics) -> None:
        self.metrics = metrics_

    def record(
        self,
        decided: settlement.Settlement,
        report: BatchReport,
        duration_s: float,
        *,
        in_flight: int,
        unsettled: int,
        not_buried: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        """Fill ``report`` with what a step settled, count it and log it; a dead row in
        ``not_buried`` (its burial was refused: parked or held) is no dead letter."""
        self.metrics.set_in_flight(in_flight)
        self.metrics.set_unsettled(unsettled)
        buried = [dead for dead in decided.dead if dead.job.id not in not_buried]
        report.published, report.dead = len(decided.published), len(buried)
        report.retried, report.rejected = decided.retried, decided.rejected
        for (backend_name, queue, outcome), count in decided.outcomes.items():
            self.metrics.count_jobs(backend_name, queue, outcome, count)
        now = time.monotonic()
        for job in decided.published:
            self.metrics.observe_delay(job.backend, job.age_s + (now - job.read_at))
        for dead in buried:
            self.metrics.count_dead(dead.job.backend, dead.job.queue)
            _dead_lettered(dead)
        self.metrics.observe_batch(duration_s, report.selected)
        if log.isEnabledFor(logging.DEBUG):
            _log_batch(decided, report, duration_s, in_flight)

    def refused(
        self, parked: list[tuple[models.StagedJob, str]], first_held: Iterable[models.StagedJob]
    ) -> None:
        """Log each row parked, and each held for the first time; count them."""
        first_held = list(first_held)
        if not parked and not first_held:
            return
        self.metrics.count_settlement_failure()
        self.metrics.count_parked(len(parked))
        for job, note in parked:
            log.warning(
                "job %s (%s) parked: %s",
                job.job_id,
                job.job_name,
                note,
                extra={
                    "event": "settlement_refused",
                    "action": "parked",
                    "backend": job.backend,
                    "queue": job.queue,
                    "job_ids": [str(job.job_id)],
                    "reason": note,
                },
            )
        for job in first_held:
            log.warning(
                "job %s (%s): the table refused its settlement, or its parking and its parking in "
                "place; held out of selection, tried again with backoff",
                job.job_id,
                job.job_name,
                extra={
                    "event": "settlement_refused",
                    "action": "held",
                    "backend": job.backend,
                    "queue": job.queue,
                    "job_ids": [str(job.job_id)],
                },
            )


def _dead_lettered(dead: settlement.Dead) -> None:
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


def _log_batch(
    decided: settlement.Settlement, report: BatchReport, duration_s: float, in_flight: int
) -> None:
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
