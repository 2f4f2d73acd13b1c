"""Turn one staged job into one AMQP message, or refuse it with the reason: pure functions, no I/O.

The message (SPEC §7): routing key = the row's ``queue``; properties ``content_type``
``application/json``, ``delivery_mode`` 2, ``message_id`` = job id, ``type`` = job name,
``timestamp`` = ``created_at`` in whole seconds, and from the row's options ``priority``,
``expiration`` and ``headers``; the body is the JSON object ``{"job_id", "job_name", "args",
"kwargs", "queue", "created_at", "options"}``.

``build`` raises ``drain.errors.JobRefused`` for everything AMQP, pika's encoder or RabbitMQ
would refuse, so that a built message can always be written and never closes the channel or the
connection (which would fail every job in flight, again and again):

- short strings (``type``, the routing key, header keys) hold at most 255 bytes of UTF-8 and no NUL;
- on the default exchange the routing key is a queue name: not empty, not ``amq.`` (the broker's
  own names: other connections' private queues, the direct reply-to pseudo-queue), as is each
  entry of ``CC`` and ``BCC`` (``amqp_names``);
- header values are strings, integers within signed 64 bits, booleans, null, arrays and objects
  of those, nested at most ``MAX_HEADER_DEPTH`` deep (pika has no encoding for a float);
- ``CC`` and ``BCC`` headers are arrays of strings (RabbitMQ routes copies by them and closes the
  channel on any other type);
- ``priority`` is an integer 0-255; ``expiration`` a number of milliseconds 0-4294967295 (an
  integer or a string of ASCII digits; RabbitMQ closes the channel on anything else);
- the encoded properties fit one AMQP frame (the broker closes the connection otherwise), and the
  body fits ``max_body_bytes``; the header frame's size stays with the message
  (``header_frame_bytes``) for ``submit`` to check again against the frame_max of the connection
  it is written on;
- the body is strict JSON: a NaN or an infinity (a Postgres numeric beyond a float's range decodes
  to ``inf``) is refused rather than sent as the non-JSON ``Infinity``;
- ``created_at`` is not before 1970 (the AMQP timestamp is unsigned).

The staging trace context (``job.traceparent``/``job.tracestate``, drain.observability.tracing) travels as the
headers ``traceparent`` and ``tracestate``; if adding them would make the properties exceed one
frame, the message goes without them rather than being refused. A schedule's tick
(``job.schedule``/``job.tick``) travels as the headers ``drain_schedule`` and ``drain_tick``
(drain.models.tick_metadata), merged into the row's ``headers`` option as if its own.

A job's ordering key travels as the header ``x-ordering-key`` (drain.models.ORDERING_KEY_HEADER),
over a header of that name in the row's ``headers`` option, and never in the body; it is never
left out for the frame's sake, as the trace context may be. With ``by_key`` (the backend's
``routing_key = "ordering_key"``) the key is also the routing key, so that a consistent-hash
exchange sends every job of one key to one queue; a job without a key keeps its queue as routing
key. A job without a key is the message it was before keys existed, byte for byte.

With headers, the properties are encoded once with pika's own encoder here, which proves the
header frame can be written and yields its size. Without headers they are a few hundred bytes of
fields validated above (far below the smallest ``frame_max``, 4096), and the encoding is skipped:
it would cost as much again as building the properties.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

import pika
import pika.spec

from drain import errors, models
from drain_adapters.amqp import names as amqp_names

KNOWN_OPTIONS = ("priority", "expiration", "headers")
MAX_PRIORITY = 255
MAX_EXPIRATION_MS = 4_294_967_295  # RabbitMQ's per-message TTL bound (2**32 - 1 ms, about 49.7 days)
MAX_HEADER_DEPTH = 32  # arrays/objects inside headers; deeper is refused, not recursed into
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
HEADER_FRAME_OVERHEAD_BYTES = amqp_names.HEADER_FRAME_OVERHEAD_BYTES
CONTENT_TYPE = "application/json"
PLAIN_PROPERTIES_MAX_BYTES = 2 + (1 + 16) + 1 + (1 + 36) + (1 + 255) + 8 + 1 + (1 + 10)
"""The most the properties take encoded without headers: flags, content_type, delivery_mode,
message_id, type (a short string), timestamp, priority and expiration (ten digits)."""


class Message(NamedTuple):
    """One job as it goes on the wire: ``basic_publish(exchange, routing_key, body, properties)``."""

    routing_key: str
    body: bytes
    properties: pika.BasicProperties
    header_frame_bytes: int = HEADER_FRAME_OVERHEAD_BYTES + PLAIN_PROPERTIES_MAX_BYTES
    """The content header frame's size (an upper bound when there are no headers)."""


def build(
    job: models.StagedJob,
    *,
    max_body_bytes: int,
    frame_max: int,
    exchange: str = amqp_names.DEFAULT_EXCHANGE,
    by_key: bool = False,
) -> Message:
    """The message for ``job``, to be published to ``exchange``; raise JobRefused saying why it
    cannot be one.

    ``frame_max`` is the connection's negotiated maximum frame size (the properties must fit one
    frame); ``max_body_bytes`` bounds the JSON body. ``by_key``: a job's ordering key, when it
    has one, is its routing key (a named exchange only: settings check it).
    """
    if exchange == amqp_names.DEFAULT_EXCHANGE:
        refuse(amqp_names.queue_name_problem(job.queue, "queue (the routing key)"))
    else:
        short_string(job.queue, "queue (the routing key)")
    routing_key = job.queue
    if by_key and job.ordering_key is not None:
        routing_key = short_string(job.ordering_key, "ordering_key (the routing key)")
    job = with_tick_headers(job)
    chosen = option_properties(job.options)
    own_headers = key_headers(job, chosen.get("headers"))
    refuse(amqp_names.routed_copies_problem(own_headers or {}, exchange))
    if own_headers is not None:
        chosen["headers"] = own_headers
    traced = trace_headers(job, own_headers)
    if traced is not None:
        chosen["headers"] = traced
    properties = pika.BasicProperties(
        content_type=CONTENT_TYPE,
        delivery_mode=pika.DeliveryMode.Persistent,
        message_id=str(job.job_id),
        type=short_string(job.job_name, "job_name (the AMQP type)"),
        timestamp=timestamp(job),
        **chosen,
    )
    header_frame_bytes = HEADER_FRAME_OVERHEAD_BYTES + PLAIN_PROPERTIES_MAX_BYTES
    if properties.headers is not None:
        encoded = sum(len(piece) for piece in properties.encode())
        if encoded + HEADER_FRAME_OVERHEAD_BYTES > frame_max and traced is not None:
            # the trace context never costs a job its delivery: without it the headers may fit
            properties.headers = own_headers
            encoded = sum(len(piece) for piece in properties.encode()) if own_headers is not None else 0
        if encoded + HEADER_FRAME_OVERHEAD_BYTES > frame_max:
            raise errors.JobRefused(
                f"its properties take {encoded} bytes encoded, more than one AMQP frame "
                f"(frame_max {frame_max}); the headers are too large"
            )
        header_frame_bytes = HEADER_FRAME_OVERHEAD_BYTES + encoded
    message_body = body(job)
    if len(message_body) > max_body_bytes:
        raise errors.JobRefused(f"message of {len(message_body)} bytes exceeds max_message_bytes")
    return Message(routing_key, message_body, properties, header_frame_bytes)


def refuse(problem: str | None) -> None:
    if problem:
        raise errors.JobRefused(problem)


def with_tick_headers(job: models.StagedJob) -> models.StagedJob:
    """A schedule's tick with its name and tick in its ``headers`` option, as if the row's own
    (the message's headers and its body's options both show them); any other job as it is."""
    headers = job.options.get("headers")
    if not models.tick_metadata(job) or not (headers is None or isinstance(headers, Mapping)):
        return job
    options = models.jsonb_ordered({**job.options, "headers": models.with_tick(headers, job)})
    return dataclasses.replace(job, options=options)


def key_headers(job: models.StagedJob, headers: dict[str, Any] | None) -> dict[str, Any] | None:
    """The row's headers with the job's ordering key under ``x-ordering-key`` (replacing a header
    of that name: the consumer must see the key the drain kept the order of); as they are for a
    job without a key."""
    if job.ordering_key is None:
        return headers
    return {**(headers or {}), models.ORDERING_KEY_HEADER: job.ordering_key}


def trace_headers(job: models.StagedJob, headers: dict[str, Any] | None) -> dict[str, Any] | None:
    """The message headers with the staging trace context added as ``traceparent`` and
    ``tracestate`` (what the pika OpenTelemetry instrumentation extracts on the consumer side);
    a header of the row's own ``headers`` option wins. None when the job carries no context."""
    if job.traceparent is None:
        return None
    trace = {"traceparent": job.traceparent}
    if job.tracestate is not None:
        trace["tracestate"] = job.tracestate
    return {**trace, **headers} if headers else trace


def body(job: models.StagedJob) -> bytes:
    """The JSON body; JobRefused when a value has no JSON form (NaN, an infinity, too deep)."""
    try:
        text = json.dumps(
            {
                "job_id": str(job.job_id),
                "job_name": job.job_name,
                "args": list(job.args),
                "kwargs": dict(job.kwargs),
                "queue": job.queue,
                "created_at": job.created_at.isoformat(),
                "options": dict(job.options),
            },
            separators=(",", ":"),
            allow_nan=False,
        )
    except ValueError as exc:  # NaN/inf, or an integer too long to print
        raise errors.JobRefused(f"the job's arguments or options are not valid JSON: {exc}") from None
    except RecursionError:
        raise errors.JobRefused("the job's arguments or options are nested too deeply") from None
    return text.encode()


def option_properties(opts: Mapping[str, Any]) -> dict[str, Any]:
    """``priority``, ``expiration`` and ``headers`` from the row's options, validated."""
    if not opts:
        return {}
    unknown = sorted(set(opts) - set(KNOWN_OPTIONS))
    if unknown:
        raise errors.JobRefused(
            f"unknown RabbitMQ option(s) {', '.join(unknown)} (known: {', '.join(KNOWN_OPTIONS)})"
        )
    properties: dict[str, Any] = {}
    priority = opts.get("priority")
    if priority is not None:
        if not is_int(priority) or not 0 <= priority <= MAX_PRIORITY:
            raise errors.JobRefused(
                f"RabbitMQ option priority must be an integer 0-{MAX_PRIORITY}, not {preview(priority)}"
            )
        properties["priority"] = priority
    expiration = opts.get("expiration")
    if expiration is not None:
        properties["expiration"] = str(expiration_ms(expiration))
    headers = opts.get("headers")
    if headers is not None:
        if not isinstance(headers, dict):
            raise errors.JobRefused("RabbitMQ option headers must be an object")
        check_table(headers, "headers", 1)
        properties["headers"] = headers
    return properties


def expiration_ms(value: Any) -> int:
    """The ``expiration`` option as milliseconds (an integer, or a string of ASCII digits)."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 10:
        value = int(value)
    if not is_int(value) or not 0 <= value <= MAX_EXPIRATION_MS:
        raise errors.JobRefused(
            f"RabbitMQ option expiration must be milliseconds 0-{MAX_EXPIRATION_MS}, not {preview(value)}"
        )
    result: int = value
    return result


def check_table(table: Mapping[Any, Any], path: str, depth: int) -> None:
    """Refuse what an AMQP field table cannot carry (see the module docstring)."""
    if depth > MAX_HEADER_DEPTH:
        raise errors.JobRefused(f"{path} is nested more than {MAX_HEADER_DEPTH} deep")
    for key, value in table.items():
        if not isinstance(key, str):
            raise errors.JobRefused(f"a key in {path} is not a string")
        short_string(key, f"a key in {path}")
        check_value(value, f"{path}.{preview(key, 40)}", depth)


def check_value(value: Any, path: str, depth: int) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        utf8(value, path)
    elif isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise errors.JobRefused(f"{path}: {preview(value)} is outside signed 64 bits")
    elif isinstance(value, dict):
        check_table(value, path, depth + 1)
    elif isinstance(value, list):
        if depth + 1 > MAX_HEADER_DEPTH:
            raise errors.JobRefused(f"{path} is nested more than {MAX_HEADER_DEPTH} deep")
        for index, item in enumerate(value):
            check_value(item, f"{path}[{index}]", depth + 1)
    elif isinstance(value, float):
        raise errors.JobRefused(f"{path}: a float cannot be an AMQP header value (send it as a string)")
    else:
        raise errors.JobRefused(f"{path}: a {type(value).__name__} cannot be an AMQP header value")


def short_string(text: str, what: str) -> str:
    """``text`` if it is a valid AMQP short string: at most 255 bytes of UTF-8, no NUL."""
    refuse(amqp_names.short_string_problem(text, what))
    return text


def utf8(text: str, what: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError:
        raise errors.JobRefused(f"{what} is not valid Unicode (a lone surrogate)") from None


def timestamp(job: models.StagedJob) -> int:
    seconds = int(job.created_at.timestamp())
    if seconds < 0:
        raise errors.JobRefused("created_at is before 1970, which an AMQP timestamp cannot carry")
    return seconds


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def preview(value: Any, limit: int = 24) -> str:
    """A bounded ``repr`` for an error message (the reason is stored; a payload is not)."""
    if is_int(value) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"  # str() of a huge int is slow or refused
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
