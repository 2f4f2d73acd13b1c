"""What a batch's per-job results mean for its rows: a pure function, no database, no broker.

::

    PUBLISHED            -> delete the row
    RETRY    (a nack)    -> push run_at back briefly (or by the result's retry_after_s: a queue
                            that keeps refusing waits longer, drain.relay.availability); no attempt
                            counted
    REJECTED             -> attempts + 1, last_error, run_at pushed back exponentially (with jitter);
                            at the backend's max_attempts: move to the dead-letter table instead

A job with no result (its backend was unavailable, or it is still in flight) is left alone.
Every action names its row by id *and* job_id (drain.store.session): an id reused since the row was read
is another job.
"""

from __future__ import annotations

import collections
import dataclasses
import uuid
from collections.abc import Callable, Iterable, Mapping

from drain import models
from drain.relay import backoff

MAX_ERROR_CHARS = 2000
NACK_DELAY_S = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class Retry:
    """A failed row to push back: ``counted`` (0 or 1) is added to its attempts."""

    row_id: int
    job_id: uuid.UUID
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

    published: list[models.StagedJob] = dataclasses.field(default_factory=list)
    """The rows to delete: their jobs were published."""
    retry: list[Retry] = dataclasses.field(default_factory=list)
    dead: list[Dead] = dataclasses.field(default_factory=list)
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
            settlement.published.append(job)
            continue
        error = storable((result.error or outcome.value)[:MAX_ERROR_CHARS])
        if outcome is models.Outcome.RETRY:
            delay = nack.delay(1) if result.retry_after_s is None else result.retry_after_s
            settlement.retry.append(Retry(job.id, job.job_id, 0, error, delay))
            continue
        attempts = job.attempts + 1
        if attempts >= max_attempts(job.backend):
            settlement.dead.append(Dead(job, error, attempts))
        else:
            settlement.retry.append(Retry(job.id, job.job_id, 1, error, retry_backoff.delay(attempts)))
    return settlement


def storable(text: str) -> str:
    """An error as a text column holds it: a NUL or a lone surrogate (an adapter's message may
    carry either) would make PostgreSQL refuse the whole settlement, so they are escaped."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text
