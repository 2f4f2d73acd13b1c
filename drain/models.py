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
SCHEDULE_OPTION = "drain_schedule"
TICK_OPTION = "drain_tick"
TICK_OPTIONS = (SCHEDULE_OPTION, TICK_OPTION)
"""The reserved options a schedule's tick carries in its row (drain.relay.schedules): its
schedule's name and the tick (ISO 8601, UTC). Taken out of ``options`` when the row is read
(drain.store.reading), as the trace context is, and handed on as ``StagedJob.schedule`` and
``StagedJob.tick``; each adapter passes them on under these names where its backend can (RQ's
``job.meta``, AMQP message headers)."""
ORDERING_KEY_META = "ordering_key"
"""The key of RQ's ``job.meta`` that carries a job's ordering key (``StagedJob.ordering_key``)."""
ORDERING_KEY_HEADER = "x-ordering-key"
"""The AMQP message header that carries a job's ordering key (RabbitMQ, and Celery's message
headers, which a task reads as ``self.request.get("x-ordering-key")``)."""


MAX_KEY_BYTES = 255
"""The longest ordering key (the table's drain_key_check): the longest AMQP routing key."""


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
    schedule: str | None = None
    """The schedule whose tick this job is (SCHEDULE_OPTION), or None for a job an app staged."""
    tick: str | None = None
    """The tick this job is, ISO 8601 in UTC (TICK_OPTION), with ``schedule``."""
    ordering_key: str | None = None
    """The row's ordering key (1 to MAX_KEY_BYTES bytes), or None. The batch query forwards the rows of
    a key one at a time in id order (queries.sql key_free); adapters hand it to the consumer
    (ORDERING_KEY_META, ORDERING_KEY_HEADER)."""
    unreadable: str | None = None
    """Why the drain could not read this row (drain.store.reading), or None. Such a job has no content
    (empty args, kwargs and options, names cut short) and is rejected with this reason before any
    backend sees it: retried with backoff, then dead-lettered."""
    memory_bytes: int = 0
    """An upper estimate of what this job's decoded fields take in the drain (drain.store.reading)."""


def jsonb_ordered(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """``mapping`` with its keys in the order a jsonb object keeps them (shorter first, then by
    bytes): what an adapter adds to an object read from the row reads as if it had been stored."""
    return dict(sorted(mapping.items(), key=lambda item: (len(item[0].encode()), item[0].encode())))


def with_tick(mapping: Mapping[str, Any] | None, job: StagedJob) -> dict[str, Any]:
    """``mapping`` (a row's ``meta`` or ``headers`` option) with the job's tick metadata over
    keys of those names, in jsonb's key order, as 0.1.0 stored it; as it is for a job that is no
    tick."""
    tick = tick_metadata(job)
    if not tick:
        return dict(mapping or {})
    return jsonb_ordered({**(mapping or {}), **tick})


def tick_metadata(job: StagedJob) -> dict[str, str]:
    """The schedule's name and tick under their reserved names (TICK_OPTIONS), for an adapter to
    pass on; empty for a job that is no tick."""
    if job.schedule is None or job.tick is None:
        return {}
    return {SCHEDULE_OPTION: job.schedule, TICK_OPTION: job.tick}


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
