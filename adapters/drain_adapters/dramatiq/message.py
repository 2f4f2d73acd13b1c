"""One staged job as the message ``actor.send()`` writes, or its refusal: pure functions, no I/O.

The message (Dramatiq's ``Message.encode`` with its default JSON encoder): the compact JSON object
``{"queue_name", "actor_name", "args", "kwargs", "options", "message_id", "message_timestamp"}``,
in that order, with ``ensure_ascii`` — so the bytes are ASCII. Here ``queue_name`` is the row's
``queue``, ``actor_name`` its ``job_name``, ``message_id`` its job id and ``message_timestamp``
the publishing time in milliseconds (``send()`` stamps the time it is called). The options are
the row's, followed by what the drain adds:

- ``traceparent`` and ``tracestate``: the staging trace context (drain.observability.tracing);
- ``drain_schedule`` and ``drain_tick``: a schedule's tick (drain.models.tick_metadata);
- ``ordering_key``: the row's ordering key (drain.models.ORDERING_KEY_META);
- ``redis_message_id`` (Redis only): the key of the message in its queue's hash. ``send()`` draws
  a fresh UUID; the drain uses ``<job id>:<row id>``, so a row forwarded twice (a crash between
  Redis's reply and the database commit) is found and not written twice, while a new row staged
  under a job id already forwarded is a new message. Dramatiq's Retries middleware gives each
  retry a fresh one, as ``send()`` would.

A row is refused (its rejection, retried and then dead-lettered) for what a worker, Dramatiq or
the broker would not take: a queue name ``@dramatiq.actor`` refuses (``QUEUE_NAME``), a delay or
dead-letter queue (``.DQ``, ``.XQ``: a delayed job waits in Postgres until its ``run_at``), a name
over 252 bytes (its ``.DQ`` and ``.XQ`` must fit AMQP's 255), on Redis a name that is one of
Dramatiq's own keys there (``__heartbeats__`` and the like, a queue's ``.msgs`` hash), an
actor outside ``allowed_actors``, the options only Dramatiq itself sets (``eta``,
``redis_message_id``), a callback naming an actor outside ``allowed_actors`` or, with
``allowed_actors``, a message of its own to send later (``pipe_target``,
``group_completion_callbacks``: the drain cannot vouch for the actors they name), a
``broker_priority`` that is no integer 0-255 (AMQP's priority property), and a body over
``max_message_bytes``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping
from typing import Any

from drain import errors, models
from drain_adapters.amqp import names as amqp_names

QUEUE_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9._-]*")  # what @dramatiq.actor(queue_name=...) takes
DELAY_SUFFIX, DEAD_LETTER_SUFFIX = ".DQ", ".XQ"
MAX_QUEUE_BYTES = amqp_names.SHORT_STRING_BYTES - len(DELAY_SUFFIX)  # room for <queue>.DQ and .XQ
REDIS_OWN_PREFIX, REDIS_HASH_SUFFIX = "__", ".msgs"  # <ns>:__heartbeats__, __acks__...; <queue>.msgs
RESERVED_OPTIONS = ("eta", "redis_message_id")
CALLBACK_OPTIONS = ("on_success", "on_failure", "on_retry_exhausted")
MESSAGE_OPTIONS = ("pipe_target", "group_completion_callbacks")
PRIORITY_OPTION = "broker_priority"
MAX_PRIORITY = 255
TRACE_OPTIONS = ("traceparent", "tracestate")
REDIS_ID_OPTION = "redis_message_id"
_ENCODER = json.JSONEncoder(separators=(",", ":"))  # what json.dumps builds for each call


@dataclasses.dataclass(frozen=True, slots=True)
class DramatiqMessage:
    """One job as it goes to the broker: its queue, its id there and the encoded message."""

    job: models.StagedJob
    queue: str
    message_id: str
    """Its key in the queue's hash on Redis (``redis_message_id``); the job id on RabbitMQ."""
    body: bytes
    priority: int | None
    """``broker_priority``: the AMQP priority property (``send()`` sets it from this option)."""


def queue_problem(queue: str) -> str | None:
    """Why Dramatiq's workers could not consume a queue named ``queue`` here, or None."""
    if len(queue) > MAX_QUEUE_BYTES:  # never kept in the cache below
        return (
            f"queue name is {len(queue)} characters long; {MAX_QUEUE_BYTES} bytes at most "
            f"(its {DELAY_SUFFIX} and {DEAD_LETTER_SUFFIX} queues within AMQP's 255)"
        )
    return _queue_problem(queue)


def redis_queue_problem(queue: str) -> str | None:
    """Why ``queue`` cannot be a queue on Redis: its list would be one of Dramatiq's own keys."""
    if queue.startswith(REDIS_OWN_PREFIX) or queue.endswith(REDIS_HASH_SUFFIX):
        return (
            f"queue {queue[:100]!r} would be one of Dramatiq's own Redis keys (a name starting "
            f"with {REDIS_OWN_PREFIX!r} or ending in {REDIS_HASH_SUFFIX!r})"
        )
    return None


@functools.lru_cache(maxsize=4096)  # a drain sees the same few queues again and again
def _queue_problem(queue: str) -> str | None:
    shown = queue[:100]
    if not QUEUE_NAME.fullmatch(queue):
        return (
            f"queue {shown!r} is no Dramatiq queue name (a letter or underscore, then letters, "
            "digits, dots, dashes, underscores)"
        )
    if queue.endswith((DELAY_SUFFIX, DEAD_LETTER_SUFFIX)):
        return f"queue {shown!r} is a Dramatiq delay or dead-letter queue; use run_at to delay a job"
    return amqp_names.queue_name_problem(queue)  # RabbitMQ's bounds on any queue name


def checked_options(job: models.StagedJob, allowed: frozenset[str] | None) -> dict[str, Any]:
    """The row's options as the message carries them, or JobRefused."""
    options = dict(job.options)
    if not options and job.traceparent is None and job.schedule is None and job.ordering_key is None:
        return options
    for key in RESERVED_OPTIONS:
        if key in options:
            raise errors.JobRefused(f"option {key!r} is Dramatiq's own (delay a job with run_at)")
    for key in CALLBACK_OPTIONS:
        value = options.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise errors.JobRefused(f"option {key!r} must be an actor name")
        if allowed is not None and value not in allowed:
            raise errors.JobRefused(f"option {key!r} names actor {value[:100]!r}, not in allowed_actors")
    if allowed is not None:
        for key in MESSAGE_OPTIONS:
            if options.get(key) is not None:
                raise errors.JobRefused(
                    f"option {key!r} carries messages for other actors, which allowed_actors cannot check"
                )
    priority = options.get(PRIORITY_OPTION)
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY
    ):
        raise errors.JobRefused(f"option {PRIORITY_OPTION!r} must be an integer 0-{MAX_PRIORITY}")
    if job.traceparent is not None:
        options["traceparent"] = job.traceparent
        if job.tracestate is not None:
            options["tracestate"] = job.tracestate
    options.update(models.tick_metadata(job))
    if job.ordering_key is not None:
        options[models.ORDERING_KEY_META] = job.ordering_key
    return options


def encode(fields: Mapping[str, Any]) -> bytes:
    """Dramatiq's JSONEncoder.encode: ``json.dumps(fields, separators=(",", ":"))`` in UTF-8."""
    return _ENCODER.encode(fields).encode("utf-8")


def build(
    job: models.StagedJob,
    *,
    now_ms: int,
    allowed: frozenset[str] | None,
    max_bytes: int,
    redis: bool,
) -> DramatiqMessage:
    """The message for ``job``; raise JobRefused saying why it cannot be one.

    ``now_ms``: the message_timestamp; ``redis``: add ``redis_message_id`` (``<job id>:<row id>``)."""
    if allowed is not None and job.job_name not in allowed:
        raise errors.JobRefused(f"actor {job.job_name[:100]!r} is not in allowed_actors")
    problem = queue_problem(job.queue) or (redis_queue_problem(job.queue) if redis else None)
    if problem:
        raise errors.JobRefused(problem)
    options = checked_options(job, allowed)
    message_id = str(job.job_id)
    key = message_id
    if redis:
        key = options[REDIS_ID_OPTION] = f"{message_id}:{job.id}"
    body = encode(
        {
            "queue_name": job.queue,
            "actor_name": job.job_name,
            "args": list(job.args),
            "kwargs": dict(job.kwargs),
            "options": options,
            "message_id": message_id,
            "message_timestamp": now_ms,
        }
    )
    if len(body) > max_bytes:
        raise errors.JobRefused(f"message of {len(body)} bytes exceeds max_message_bytes ({max_bytes})")
    return DramatiqMessage(job, job.queue, key, body, options.get(PRIORITY_OPTION))
