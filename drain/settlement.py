"""What a batch's per-job results mean for its rows: a pure function, no database, no broker.

::

    PUBLISHED            -> delete the row
    RETRY    (a nack)    -> push run_at back briefly; no attempt counted
    REJECTED             -> attempts + 1, last_error, run_at pushed back exponentially (with jitter);
                            at the backend's max_attempts: move to the dead-letter table instead

A job with no result (its backend was unavailable, or it is still in flight) is left alone.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Mapping

from drain import backoff, models

MAX_ERROR_CHARS = 2000
NACK_DELAY_S = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class Retry:
    """A failed row to push back: ``counted`` (0 or 1) is added to its attempts."""

    row_id: int
    counted: int
    error: str
    delay_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class Dead:
    """A row to move to the dead-letter table with its error."""

    job: models.StagedJob
    error: str
    attempts: int


@dataclasses.dataclass
class Settlement:
    """The SQL actions one batch's results call for, and what to count."""

    delete: list[int] = dataclasses.field(default_factory=list)
    retry: list[Retry] = dataclasses.field(default_factory=list)
    dead: list[Dead] = dataclasses.field(default_factory=list)
    published: list[models.StagedJob] = dataclasses.field(default_factory=list)
    outcomes: collections.Counter[tuple[str, str, str]] = dataclasses.field(
        default_factory=collections.Counter
    )
    """(backend, queue, outcome) -> jobs."""

    @property
    def rejected(self) -> int:
        return sum(1 for retry in self.retry if retry.counted) + len(self.dead)

    @property
    def retried(self) -> int:
        return sum(1 for retry in self.retry if not retry.counted)


def decide(
    jobs: Iterable[models.StagedJob],
    results: Mapping[int, models.PublishResult],
    *,
    max_attempts: Callable[[str], int],
    retry_backoff: backoff.Backoff,
    nack_backoff: backoff.Backoff | None = None,
) -> Settlement:
    """The settlement of ``jobs`` given their ``results`` (by row id); jobs without one are skipped.

    ``max_attempts(backend)`` is that backend's limit; ``retry_backoff`` spaces a rejected job's
    attempts, ``nack_backoff`` (default: about NACK_DELAY_S) a nacked one's.
    """
    nack = nack_backoff or backoff.Backoff(NACK_DELAY_S * 2, NACK_DELAY_S * 2, retry_backoff.rand)
    settlement = Settlement()
    for job in jobs:
        result = results.get(job.id)
        if result is None:
            continue
        outcome = result.outcome
        settlement.outcomes[job.backend, job.queue, outcome.value] += 1
        if outcome is models.Outcome.PUBLISHED:
            settlement.delete.append(job.id)
            settlement.published.append(job)
            continue
        error = (result.error or outcome.value)[:MAX_ERROR_CHARS]
        if outcome is models.Outcome.RETRY:
            settlement.retry.append(Retry(job.id, 0, error, nack.delay(1)))
            continue
        attempts = job.attempts + 1
        if attempts >= max_attempts(job.backend):
            settlement.dead.append(Dead(job, error, attempts))
        else:
            settlement.retry.append(Retry(job.id, 1, error, retry_backoff.delay(attempts)))
    return settlement
