"""One staged row as the Redis writes that make it an RQ job: the lean path (no I/O here).

``Queue.enqueue_many`` builds a ``Job`` object per job, then writes: ``SADD rq:queues
rq:queue:<queue>`` once, and per job ``HSET rq:job:<id> status queued``, ``HSET rq:job:<id>
<Job.to_dict()>``, ``EXPIRE`` of the job, dependents and dependencies keys when the job has a
``ttl``, and ``RPUSH`` (``LPUSH`` with ``at_front``) of the id onto ``rq:queue:<queue>``. This
module computes the same hash fields with the same values directly (the status folded into the
one HSET; EXPIRE of the two dependency keys, which never exist for these jobs, is left out), so an
unmodified ``rq worker`` runs the job and ``rq info`` counts it. ``tests/integration/
test_rq_lean.py`` compares the result with ``enqueue_many``'s field by field for the RQ version
installed; the package pins the RQ range this was checked against.

The staging trace context (``job.traceparent``/``job.tracestate``) goes into the job's ``meta``
under those keys: the OpenTelemetry RQ instrumentation extracts its parent from ``job.meta``.
A schedule's tick (``job.schedule``/``job.tick``) goes there too, as ``drain_schedule`` and
``drain_tick`` (drain.models.tick_metadata), over keys of those names in the row's ``meta``.
A job's ordering key goes there as ``ordering_key`` (drain.models.ORDERING_KEY_META), over a key
of that name in the row's ``meta``; a job without one has exactly the ``meta`` it had before keys
existed.

One field is drain's own: ``MARK_FIELD`` = ``<row id>:<created_at>`` of the staged row, which RQ
keeps (it only ever HSETs its own fields or deletes the whole hash). The duplicate check uses it
to tell "this row's own earlier forward" from "someone else holds this job id".

Every value is encoded to bytes here, so anything a row carries that cannot be written
(unencodable text, a value the serializer refuses, recursion too deep) fails in the build —
that row's rejection — and never in the middle of a batch's transaction.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import types
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rq import job as rq_job
from rq import queue as rq_queue
from rq import utils as rq_utils

from drain import models
from drain_adapters.rq import rules as rq_rules

MARK_FIELD = b"drain_staged_row"
QUEUES_KEY = rq_queue.Queue.redis_queues_keys.encode()
QUEUE_PREFIX = rq_queue.Queue.redis_queue_namespace_prefix
JOB_PREFIX = rq_job.Job.redis_job_namespace_prefix
DEFAULT_TIMEOUT_S = rq_queue.Queue.DEFAULT_TIMEOUT
CALL_STRING_ARG_CHARS = 75  # RQ's description: get_call_string(..., max_length=75)
EMPTY = b""
QUEUED = rq_job.JobStatus.QUEUED.value.encode()
DEFAULT_TIMEOUT = str(DEFAULT_TIMEOUT_S).encode()

Serializer = Callable[[Any], bytes]


@dataclasses.dataclass(frozen=True, slots=True)
class RQMessage:
    """The writes of one job: its hash, its queue and how it expires."""

    job_key: bytes
    job_id: bytes
    queue_key: bytes
    fields: dict[bytes, bytes]
    ttl: int | None
    at_front: bool
    mark: bytes


def job_key(job_id: str) -> bytes:
    return (JOB_PREFIX + job_id).encode()


def queue_key(queue: str) -> bytes:
    return (QUEUE_PREFIX + queue).encode()


def mark_of(job: models.StagedJob) -> bytes:
    """What identifies this staged row across its forwards (a re-staged id gets a new row)."""
    return f"{job.id}:{job.created_at.isoformat()}".encode()


def timestamp(now: datetime.datetime | None = None) -> bytes:
    """RQ's timestamp format (``rq.utils.utcformat``) for created_at and enqueued_at."""
    return rq_utils.utcformat(now or rq_utils.now()).encode()


def build(
    job: models.StagedJob,
    func_name: str,
    options: rq_rules.RQOptions,
    dumps: Serializer,
    now: bytes,
) -> RQMessage:
    """The hash fields ``enqueue_many`` would write for this job (plus the mark)."""
    if not isinstance(job.queue, str) or not job.queue:
        raise ValueError("queue must be a non-empty string")
    args = _as_list(job.args)
    kwargs = _as_dict(job.kwargs)
    job_id = str(job.job_id)
    description = options.description or call_string(func_name, args, kwargs)
    fields: dict[bytes, bytes] = {
        b"created_at": now,
        b"data": zlib.compress(dumps((func_name, None, args, kwargs))),
        b"success_callback_name": EMPTY,
        b"failure_callback_name": EMPTY,
        b"stopped_callback_name": EMPTY,
        b"started_at": EMPTY,
        b"ended_at": EMPTY,
        b"last_heartbeat": EMPTY,
        b"worker_name": EMPTY,
        b"group_id": EMPTY,
        b"origin": job.queue.encode(),
        b"description": (description or "").encode(),
        b"enqueued_at": now,
        b"timeout": DEFAULT_TIMEOUT if options.timeout is None else _int(options.timeout),
        b"status": QUEUED,
    }
    if options.retry_max is not None:
        fields[b"retries_left"] = _int(options.retry_max)
        fields[b"retry_intervals"] = json.dumps(options.retry_intervals).encode()
    if options.result_ttl is not None:
        fields[b"result_ttl"] = _int(options.result_ttl)
    if options.failure_ttl is not None:
        fields[b"failure_ttl"] = _int(options.failure_ttl)
    meta = keyed_meta(job, trace_meta(job, models.with_tick(options.meta, job)))
    if meta:
        fields[b"meta"] = dumps(meta)
    if options.ttl:
        fields[b"ttl"] = _int(options.ttl)
    mark = mark_of(job)
    fields[MARK_FIELD] = mark
    return RQMessage(
        job_key=job_key(job_id),
        job_id=job_id.encode(),
        queue_key=queue_key(job.queue),
        fields=fields,
        ttl=options.ttl,
        at_front=options.at_front,
        mark=mark,
    )


def call_string(func_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """RQ's default description of a job (``rq.utils.get_call_string`` with ``max_length`` 75):
    ``func(arg, ..., key=value, ...)``, each value's repr cut to CALL_STRING_ARG_CHARS and
    ``...``, the keyword arguments sorted. The same text in one pass, without RQ's two calls per
    argument (tests/unit/test_rq_rules.py compares the two)."""
    shown = [_shown(repr(arg)) for arg in args]
    if kwargs:
        shown += sorted([f"{key}={_shown(repr(value))}" for key, value in kwargs.items()])
    return f"{func_name}({', '.join(shown)})"


def _shown(text: str) -> str:
    return text if len(text) <= CALL_STRING_ARG_CHARS else text[:CALL_STRING_ARG_CHARS] + "..."


def trace_meta(job: models.StagedJob, meta: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The job's ``meta``: the row's ``meta`` option with the staging trace context added under
    ``traceparent``/``tracestate`` (where an RQ worker's OpenTelemetry instrumentation, or
    ``drain.observability.tracing.context_from_rq_job``, reads it); a key the row's meta sets itself wins."""
    if job.traceparent is None:
        return dict(meta) if meta else None
    trace = {"traceparent": job.traceparent}
    if job.tracestate is not None:
        trace["tracestate"] = job.tracestate
    return {**trace, **meta} if meta else trace


def keyed_meta(job: models.StagedJob, meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """``meta`` with the job's ordering key under ``ordering_key`` (a key of that name the row's
    meta sets is replaced: the worker must see the key the drain kept the order of);
    ``meta`` as it is for a job without a key."""
    if job.ordering_key is None:
        return meta
    return {**(meta or {}), models.ORDERING_KEY_META: job.ordering_key}


def _int(value: int) -> bytes:
    return str(value).encode()


def _as_list(args: object) -> list[Any]:
    if isinstance(args, list):
        return args
    if isinstance(args, Sequence) and not isinstance(args, (str, bytes)):
        return list(args)
    raise ValueError("job_args must be a JSON array")


def _as_dict(kwargs: object) -> dict[str, Any]:
    if isinstance(kwargs, dict):
        return kwargs
    if isinstance(kwargs, types.MappingProxyType):  # a row's empty kwargs (drain.store.reading)
        return dict(kwargs)
    if isinstance(kwargs, Mapping):
        return dict(kwargs)
    raise ValueError("job_kwargs must be a JSON object")
