"""Value types shared by the relay, the store and the adapters. No I/O here."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_TABLE = "staged_jobs"
"""The staged-jobs table of ``stage()`` and of a drain when nothing says otherwise."""
DEFAULT_SCHEMA = "public"


@dataclasses.dataclass(frozen=True, slots=True)
class StagedJob:
    """One row of the staged-jobs table, as read by the leader."""

    id: int
    job_id: uuid.UUID
    job_name: str
    args: Sequence[Any]
    kwargs: Mapping[str, Any]
    queue: str
    backend: str
    options: Mapping[str, Any]
    created_at: datetime.datetime
    attempts: int = 0
    run_at: datetime.datetime | None = None
    age_s: float = 0.0
    """Seconds since ``created_at`` when the row was read, on the database's clock."""
    read_at: float = 0.0
    """``time.monotonic()`` of this process when the row was read (with ``age_s``: no clock skew)."""
    traceparent: str | None = None
    """The W3C trace context the job was staged in, taken out of ``options`` and validated when
    the row was read (drain.observability.tracing); None when the row carries none or a malformed one."""
    tracestate: str | None = None
    unreadable: str | None = None
    """Why the drain could not read this row (drain.store.reading), or None. Such a job has no content
    (empty args, kwargs and options, names cut short) and is rejected with this reason before any
    backend sees it: retried with backoff, then dead-lettered."""
    memory_bytes: int = 0
    """An upper estimate of what this job's decoded fields take in the drain (drain.store.reading)."""


class Outcome(enum.Enum):
    """What became of one job handed to an adapter."""

    PUBLISHED = "published"
    """The backend acknowledged the job durably; its row may be deleted."""
    RETRY = "retry"
    """A transient failure of this job alone (a nack, a closed channel); try again soon."""
    REJECTED = "rejected"
    """The backend refuses this job (unroutable, bad options, not allowed); counts an attempt."""


@dataclasses.dataclass(frozen=True, slots=True)
class PublishResult:
    """The outcome of one job; ``error`` says why when it was not published; ``retry_after_s``
    (a RETRY only) how long its row waits before it is tried again, when not the default."""

    row_id: int
    outcome: Outcome
    error: str | None = None
    retry_after_s: float | None = None

    @classmethod
    def published(cls, job: StagedJob) -> PublishResult:
        return cls(job.id, Outcome.PUBLISHED)

    @classmethod
    def retry(cls, job: StagedJob, error: str) -> PublishResult:
        return cls(job.id, Outcome.RETRY, error)

    @classmethod
    def rejected(cls, job: StagedJob, error: str) -> PublishResult:
        return cls(job.id, Outcome.REJECTED, error)
