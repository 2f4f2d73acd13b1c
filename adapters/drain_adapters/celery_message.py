"""One staged row as the Celery task message ``send_task`` would send, built by Celery itself.

``build`` calls ``app.amqp.as_task_v2`` (message protocol 2, the builder ``send_task`` uses) with
``task_id = job_id``, then does what ``send_task`` and kombu's ``Producer.publish`` do next: the
row's ``headers`` option merged into the message headers, the body serialised by kombu's JSON
serializer, ``delivery_mode`` persistent, ``priority`` (0 unless given), ``expiration`` in
milliseconds from ``expires``. The queue is reached as ``send_task(queue=...)`` reaches it with
Celery's default routing: the default exchange ``""`` with routing key = the queue name.

Row options (anything else makes the row REJECTED)::

    priority         integer 0-255 (Celery on Redis uses 0-9)
    expires          seconds from when the drain forwards the row, or an ISO 8601 date
    time_limit       hard time limit in seconds (a number)
    soft_time_limit  soft time limit in seconds (a number)
    headers          an object merged into the message headers; Celery's own names are refused
    retries          the retries count the task starts with (an integer >= 0)
    ignore_result    true or false
    shadow           the name shown for the task in logs and monitors

The staging trace context (``job.traceparent``/``job.tracestate``, drain.tracing) goes into the
message headers under those names, so a worker sees it as ``task.request.traceparent``.

No I/O here: ``build`` may raise JobRefused (or anything, the net in ``backend.build_each``).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Callable, Mapping
from typing import Any

import celery
from kombu import serialization

from drain import errors, models

SERIALIZER = "json"
_dumps: Callable[..., tuple[str, str, bytes | str]] = serialization.dumps  # kombu's, untyped
PERSISTENT = 2  # AMQP delivery_mode: the broker writes the message to disk
DEFAULT_PRIORITY = 0  # kombu's Producer.publish default
MAX_PRIORITY = 255
MAX_SHORTSTR_BYTES = 255  # AMQP short strings (the routing key) hold at most 255 bytes
NUMBER_OPTIONS = ("time_limit", "soft_time_limit")
KNOWN_OPTIONS = ("priority", "expires", *NUMBER_OPTIONS, "headers", "retries", "ignore_result", "shadow")
# The protocol-2 headers Celery writes itself: a row may not replace them (``id`` is the job id).
PROTOCOL_HEADERS = frozenset(
    (
        "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
        "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
        "replaced_task_nesting", "stamped_headers", "stamps", "compression",
    )
)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class CeleryMessage:
    """What kombu hands to the transport: body bytes, headers and message properties."""

    job: models.StagedJob
    body: bytes
    content_type: str
    content_encoding: str
    headers: dict[str, Any]
    properties: dict[str, Any]  # correlation_id, reply_to, delivery_mode, priority, [expiration]
    routing_key: str
    exchange: str = ""


def new_app() -> celery.Celery:
    """A Celery app that only builds messages (it never connects)."""
    app = celery.Celery("drain", set_as_current=False)
    app.conf.task_protocol = 2
    app.conf.task_serializer = SERIALIZER
    return app


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise errors.JobRefused(f"Celery option {key} must be a number of seconds, not {value!r}")
    if value < 0:
        raise errors.JobRefused(f"Celery option {key} must not be negative, not {value!r}")
    return float(value)


def _expires(value: Any, now: datetime.datetime) -> tuple[str, float]:
    """The ISO date Celery puts in the ``expires`` header and the message TTL in seconds."""
    if isinstance(value, str):
        try:
            when = datetime.datetime.fromisoformat(value)
        except ValueError:
            raise errors.JobRefused(f"Celery option expires is not an ISO 8601 date: {value!r}") from None
        if when.tzinfo is None:
            raise errors.JobRefused("Celery option expires must carry a time zone offset")
    else:
        when = now + datetime.timedelta(seconds=_seconds("expires", value))
    # send_task: an expiry in the past becomes a TTL of 0 (expired on arrival), not an error.
    return when.isoformat(), max(0.0, (when - now).total_seconds())


def _checked_options(options: Mapping[str, Any]) -> None:
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise errors.JobRefused(
            f"unknown Celery option(s) {', '.join(unknown)} (known: {', '.join(KNOWN_OPTIONS)})"
        )
    priority = options.get("priority")
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY
    ):
        raise errors.JobRefused(f"Celery option priority must be an integer 0-255, not {priority!r}")
    retries = options.get("retries")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        raise errors.JobRefused(f"Celery option retries must be an integer >= 0, not {retries!r}")
    if not isinstance(options.get("ignore_result", False), bool):
        raise errors.JobRefused("Celery option ignore_result must be true or false")
    shadow = options.get("shadow")
    if shadow is not None and not (isinstance(shadow, str) and shadow):
        raise errors.JobRefused("Celery option shadow must be a non-empty string")
    headers = options.get("headers")
    if headers is not None:
        if not isinstance(headers, dict):
            raise errors.JobRefused("Celery option headers must be an object")
        taken = sorted(PROTOCOL_HEADERS.intersection(headers))
        if taken:
            raise errors.JobRefused(f"Celery option headers may not set Celery's own {', '.join(taken)}")


def build(
    app: celery.Celery, job: models.StagedJob, *, reply_to: str, now: datetime.datetime
) -> CeleryMessage:
    """The message ``app.send_task(job_name, args, kwargs, task_id=job_id, queue=queue, ...)``
    would publish for ``job`` (``now``: the moment the batch is forwarded)."""
    options = job.options
    _checked_options(options)
    if len(job.queue.encode()) > MAX_SHORTSTR_BYTES:
        raise errors.JobRefused(f"queue name longer than {MAX_SHORTSTR_BYTES} bytes")
    limits = {key: _seconds(key, options[key]) for key in NUMBER_OPTIONS if options.get(key) is not None}
    expires, expiration = (
        (None, None) if options.get("expires") is None else _expires(options["expires"], now)
    )
    task_id = str(job.job_id)
    headers, properties, body, _sent_event = app.amqp.as_task_v2(
        task_id,
        job.job_name,
        list(job.args),
        dict(job.kwargs),
        expires=expires,
        retries=options.get("retries", 0),
        reply_to=reply_to,
        time_limit=limits.get("time_limit"),
        soft_time_limit=limits.get("soft_time_limit"),
        shadow=options.get("shadow"),
        ignore_result=options.get("ignore_result"),  # send_task sends None when not given
    )
    if job.traceparent is not None:
        # task.request.traceparent on the worker, where Celery's OpenTelemetry instrumentation
        # extracts the parent context from; the row's own headers option wins
        headers["traceparent"] = job.traceparent
        if job.tracestate is not None:
            headers["tracestate"] = job.tracestate
    headers.update(options.get("headers") or {})
    content_type, content_encoding, payload = _dumps(body, serializer=SERIALIZER)
    properties = dict(properties)
    properties["delivery_mode"] = PERSISTENT
    if expiration is not None:
        properties["expiration"] = str(int(expiration * 1000))
    properties["priority"] = options.get("priority") or DEFAULT_PRIORITY
    return CeleryMessage(
        job=job,
        body=payload if isinstance(payload, bytes) else payload.encode(content_encoding),
        content_type=content_type,
        content_encoding=content_encoding,
        headers=headers,
        properties=properties,
        routing_key=job.queue,
    )
