"""One staged row as the Celery task message ``send_task`` would send, byte for byte.

``send_task`` calls ``app.amqp.as_task_v2`` (message protocol 2) with ``task_id = job_id``, then
does what kombu's ``Producer.publish`` does next: the row's ``headers`` option merged into the
message headers, the body serialised by kombu's JSON serializer, ``delivery_mode`` persistent,
``priority`` (0 unless given), ``expiration`` in milliseconds from ``expires``. The queue is
reached as ``send_task(queue=...)`` reaches it with Celery's default routing: the default
exchange ``""`` with routing key = the queue name.

``build`` makes that message in one of two ways, which make the same bytes:

- with ``protocol`` (``Protocol2.of(app)``, once a batch), the drain's own builder: the
  protocol-2 headers written as ``as_task_v2`` writes them (the same keys in the same order;
  ``origin`` computed once a batch, not once a message), ``argsrepr``/``kwargsrepr`` rendered
  here when they fit in Celery's limit (where Celery's ``saferepr`` renders them the same,
  ``_saferepr_of``) and by ``saferepr`` otherwise, the body by kombu's JSON encoder made once;
  a row it does not render (any exception) goes through Celery's builder instead. About 4× as
  fast as Celery's builder (the CHANGELOG has the figures).
- without, Celery's ``as_task_v2`` and kombu's ``serialization.dumps``, for each message.

The adapter uses the first only for an app ``probe`` passes: at ``open`` (or its first batch) it
builds rows with every option both ways and compares the bytes, keys in order and value types;
another Celery or kombu, or a configuration changing the message, keeps Celery's builder (logged
once: ``celery_builder_differs``). tests/unit/test_celery_fast_message.py compares the two on
whatever hypothesis generates.

Row options (anything else makes the row REJECTED)::

    priority         integer 0-255 (Celery on Redis uses 0-9)
    expires          seconds from when the drain forwards the row, or an ISO 8601 date with a
                     time zone, within Python's dates in UTC (the worker compares it with now);
                     a date is sent in ISO 8601's extended form (``isoformat()``: the same instant,
                     where ``send_task`` would pass the text on as given, basic or week forms too)
    time_limit       hard time limit in seconds (a number)
    soft_time_limit  soft time limit in seconds (a number)
    headers          an object merged into the message headers; Celery's own names are refused
    retries          the retries count the task starts with (an integer 0 to 2**63-1)
    ignore_result    true or false
    shadow           the name shown for the task in logs and monitors

``expires`` also becomes the message TTL (the AMQP ``expiration`` property, in milliseconds), as
``send_task`` makes it; an expiry further than ``MAX_EXPIRATION_MS`` away is sent without a TTL
(RabbitMQ closes the channel on a larger one; the worker still discards the task once it
expired), one in the past as a TTL of 0. The job name, the queue, ``shadow`` and every text in
``headers`` must be valid Unicode (no lone surrogate: no UTF-8 form).

The staging trace context (``job.traceparent``/``job.tracestate``, drain.observability.tracing) goes into the
message headers under those names, so a worker sees it as ``task.request.traceparent``.
A job's ordering key goes into the message headers as ``x-ordering-key``
(drain.models.ORDERING_KEY_HEADER), over a header of that name in the row's ``headers`` option:
a task reads it as ``self.request.get("x-ordering-key")``. A job without a key is the message it
was before keys existed.

No I/O here: ``build`` may raise JobRefused (or anything, the net in ``backend.build_each``).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import celery
from celery.utils import nodenames
from celery.utils import saferepr as celery_saferepr
from kombu import serialization
from kombu.utils import json as kombu_json

from drain import errors, models
from drain_adapters.amqp import names as amqp_names

SERIALIZER = "json"
_dumps: Callable[..., tuple[str, str, bytes | str]] = serialization.dumps  # kombu's, untyped
_saferepr: Callable[..., str] = celery_saferepr.saferepr  # Celery's, untyped
_anon_nodename: Callable[[], str] = nodenames.anon_nodename
# kombu's JSON serializer is json.dumps(data, cls=kombu's JSONEncoder) with json's defaults: that
# encoder made once (``probe`` compares its output with kombu's before the drain relies on it).
_encode: Callable[[Any], str] = kombu_json.JSONEncoder().encode
JSON_CONTENT_TYPE = "application/json"
JSON_CONTENT_ENCODING = "utf-8"
PERSISTENT = 2  # AMQP delivery_mode: the broker writes the message to disk
DEFAULT_PRIORITY = 0  # kombu's Producer.publish default
MAX_PRIORITY = 255
MAX_SHORTSTR_BYTES = amqp_names.SHORT_STRING_BYTES  # the routing key: at most 255 bytes
MAX_EXPIRATION_MS = 4_294_967_295  # the largest per-message TTL every RabbitMQ takes (2**32-1 ms)
MAX_RETRIES = 2**63 - 1  # an AMQP header integer is signed 64-bit
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
    """``value`` as given (an integer stays one: send_task's header carries ``30``, not ``30.0``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise errors.JobRefused(f"Celery option {key} must be a number of seconds, not {value!r}")
    if value < 0:
        raise errors.JobRefused(f"Celery option {key} must not be negative, not {value!r}")
    return value


def _expires(value: Any, now: datetime.datetime) -> tuple[str, str | None]:
    """The ISO date Celery puts in the ``expires`` header and the message TTL (the ``expiration``
    property: milliseconds as text), None when the expiry lies beyond what RabbitMQ takes."""
    if isinstance(value, str):
        try:
            when = datetime.datetime.fromisoformat(value)
        except ValueError:
            raise errors.JobRefused(
                f"Celery option expires is not an ISO 8601 date: {value[:40]!r}"
            ) from None
        if when.tzinfo is None:
            raise errors.JobRefused("Celery option expires must carry a time zone offset")
        try:
            when.astimezone(datetime.UTC)  # the worker compares it with its clock
        except OverflowError:
            raise errors.JobRefused(
                f"Celery option expires is outside the dates Python holds in UTC: {value[:40]!r}"
            ) from None
    else:
        try:
            when = now + datetime.timedelta(seconds=_seconds("expires", value))
        except OverflowError:
            raise errors.JobRefused(
                f"Celery option expires is too far ahead: {value!r} seconds is past the year 9999"
            ) from None
    # send_task: an expiry in the past becomes a TTL of 0 (expired on arrival), not an error.
    milliseconds = max(0, int((when - now).total_seconds() * 1000))
    return when.isoformat(), str(milliseconds) if milliseconds <= MAX_EXPIRATION_MS else None


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
    if retries is not None and (
        isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES
    ):
        shown = retries if not isinstance(retries, int) or retries < 0 else "a larger integer"
        raise errors.JobRefused(f"Celery option retries must be an integer 0-{MAX_RETRIES}, not {shown!r}")
    if not isinstance(options.get("ignore_result", False), bool):
        raise errors.JobRefused("Celery option ignore_result must be true or false")
    shadow = options.get("shadow")
    if shadow is not None and not (isinstance(shadow, str) and shadow):
        raise errors.JobRefused("Celery option shadow must be a non-empty string")
    if shadow is not None:
        _unicode(shadow, "Celery option shadow")
    headers = options.get("headers")
    if headers is not None:
        if not isinstance(headers, dict):
            raise errors.JobRefused("Celery option headers must be an object")
        taken = sorted(PROTOCOL_HEADERS.intersection(headers))
        if taken:
            raise errors.JobRefused(f"Celery option headers may not set Celery's own {', '.join(taken)}")
        problem = amqp_names.header_text_problem(headers, "Celery option headers")
        if problem:
            raise errors.JobRefused(problem)


def _unicode(text: str, what: str) -> None:
    problem = amqp_names.unicode_problem(text, what)
    if problem:
        raise errors.JobRefused(problem)


@dataclasses.dataclass(frozen=True, slots=True)
class Protocol2:
    """What the drain's own protocol-2 builder takes from the app, read once a batch: the
    ``origin`` header (``gen<pid>@<host>``: what ``as_task_v2`` computes per message) and the
    limits of ``argsrepr``/``kwargsrepr``."""

    origin: str
    maxlevels: int
    args_maxsize: int
    kwargs_maxsize: int
    empty_argsrepr: str  # as_task_v2 turns empty args into ``()``

    @classmethod
    def of(cls, app: celery.Celery) -> Protocol2:
        maxlevels: int = app.conf.task_repr_maxlevels
        args_maxsize: int = app.amqp.argsrepr_maxsize
        return cls(
            origin=_anon_nodename(),
            maxlevels=maxlevels,
            args_maxsize=args_maxsize,
            kwargs_maxsize=app.amqp.kwargsrepr_maxsize,
            empty_argsrepr=_saferepr((), args_maxsize, maxlevels=maxlevels),
        )


class _NotJson(Exception):
    """A value ``_shown`` does not render itself (or one too long to be shown whole)."""


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "\\'") + "'"


def _shown(value: Any, level: int, maxlevels: int, maxsize: int) -> str:
    """Celery's ``saferepr`` of a JSON value when nothing in it is cut short: each string in
    single quotes with ``'`` escaped (nothing else), numbers and booleans by ``str``, ``None``,
    ``[a, b]``, ``{'k': v}``, a list or object ``level`` >= ``maxlevels`` deep as ``[...]`` or
    ``{...}``. Raises _NotJson for anything else and for a text, list or object longer than
    ``maxsize`` (it would not be shown whole)."""
    kind = type(value)
    if kind is str:
        if len(value) > maxsize:
            raise _NotJson
        return _quoted(value)
    if kind is int or kind is float or kind is bool:
        return str(value)
    if value is None:
        return "None"
    if kind is list:
        if maxlevels and level >= maxlevels:
            return "[...]"
        if len(value) > maxsize:
            raise _NotJson
        level += 1
        return "[" + ", ".join([_shown(item, level, maxlevels, maxsize) for item in value]) + "]"
    if kind is dict:
        if maxlevels and level >= maxlevels:
            return "{...}"
        if len(value) > maxsize:
            raise _NotJson
        level += 1
        parts = []
        for key, item in value.items():
            if type(key) is not str or len(key) > maxsize:
                raise _NotJson
            parts.append(_quoted(key) + ": " + _shown(item, level, maxlevels, maxsize))
        return "{" + ", ".join(parts) + "}"
    raise _NotJson


def _saferepr_of(value: list[Any] | dict[str, Any], maxsize: int, maxlevels: int) -> str:
    """``saferepr(value, maxsize, maxlevels=maxlevels)``, rendered by ``_shown`` when it fits in
    ``maxsize``: then Celery's output is that rendering exactly (every token Celery's streaming
    repr yields is shorter than the room left before it, so nothing is cut; the probe and
    tests/unit/test_celery_fast_message.py check it). Anything else is Celery's own output."""
    try:
        shown = _shown(value, 0, maxlevels, maxsize)
    except Exception:  # noqa: BLE001 - _NotJson, an int too long for str(), a nesting too deep
        return _saferepr(value, maxsize, maxlevels=maxlevels)
    return shown if len(shown) <= maxsize else _saferepr(value, maxsize, maxlevels=maxlevels)


def _task_message(
    app: celery.Celery,
    job: models.StagedJob,
    *,
    task_id: str,
    expires: str | None,
    limits: dict[str, float],
    reply_to: str,
    protocol: Protocol2 | None,
) -> tuple[dict[str, Any], dict[str, Any], bytes, str, str]:
    """Headers, properties, body bytes, content type and encoding: ``as_task_v2`` then kombu's
    JSON serializer, or the same built here when ``protocol`` is given."""
    options = job.options
    args = list(job.args)
    kwargs = dict(job.kwargs)
    if protocol is not None:
        try:
            maxlevels = protocol.maxlevels
            headers = {
                "lang": "py",
                "task": job.job_name,
                "id": task_id,
                "shadow": options.get("shadow"),
                "eta": None,
                "expires": expires,
                "group": None,
                "group_index": None,
                "retries": options.get("retries", 0),
                "timelimit": [limits.get("time_limit"), limits.get("soft_time_limit")],
                "root_id": task_id,
                "parent_id": None,
                "argsrepr": (
                    _saferepr_of(args, protocol.args_maxsize, maxlevels) if args else protocol.empty_argsrepr
                ),
                "kwargsrepr": _saferepr_of(kwargs, protocol.kwargs_maxsize, maxlevels),
                "origin": protocol.origin,
                "ignore_result": options.get("ignore_result"),
                "replaced_task_nesting": 0,
                "stamped_headers": None,
                "stamps": {},
            }
            body = _encode(
                (args or (), kwargs, {"callbacks": None, "errbacks": None, "chain": None, "chord": None})
            )
            return (
                headers,
                {"correlation_id": task_id, "reply_to": reply_to or ""},
                body.encode(JSON_CONTENT_ENCODING),
                JSON_CONTENT_TYPE,
                JSON_CONTENT_ENCODING,
            )
        except Exception:  # noqa: BLE001 - Celery's builder below raises what it raises, as before
            pass
    headers, properties, body, _sent_event = app.amqp.as_task_v2(
        task_id,
        job.job_name,
        args,
        kwargs,
        expires=expires,
        retries=options.get("retries", 0),
        reply_to=reply_to,
        time_limit=limits.get("time_limit"),
        soft_time_limit=limits.get("soft_time_limit"),
        shadow=options.get("shadow"),
        ignore_result=options.get("ignore_result"),  # send_task sends None when not given
    )
    content_type, content_encoding, payload = _dumps(body, serializer=SERIALIZER)
    return (
        headers,
        dict(properties),
        payload if isinstance(payload, bytes) else payload.encode(content_encoding),
        content_type,
        content_encoding,
    )


def build(
    app: celery.Celery,
    job: models.StagedJob,
    *,
    reply_to: str,
    now: datetime.datetime,
    protocol: Protocol2 | None = None,
) -> CeleryMessage:
    """The message ``app.send_task(job_name, args, kwargs, task_id=job_id, queue=queue, ...)``
    would publish for ``job`` (``now``: the moment the batch is forwarded). With ``protocol``
    (``Protocol2.of(app)``, for an app ``probe`` passed) the drain builds it without Celery's
    builder; otherwise ``as_task_v2`` does."""
    options = job.options
    _checked_options(options)
    _unicode(job.job_name, "the job name")
    _unicode(job.queue, "the queue name")
    if len(job.queue.encode()) > MAX_SHORTSTR_BYTES:
        raise errors.JobRefused(f"queue name longer than {MAX_SHORTSTR_BYTES} bytes")
    limits = {key: _seconds(key, options[key]) for key in NUMBER_OPTIONS if options.get(key) is not None}
    expires, expiration = (
        (None, None) if options.get("expires") is None else _expires(options["expires"], now)
    )
    headers, properties, body, content_type, content_encoding = _task_message(
        app,
        job,
        task_id=str(job.job_id),
        expires=expires,
        limits=limits,
        reply_to=reply_to,
        protocol=protocol,
    )
    if job.traceparent is not None:
        # task.request.traceparent on the worker, where Celery's OpenTelemetry instrumentation
        # extracts the parent context from; the row's own headers option wins
        headers["traceparent"] = job.traceparent
        if job.tracestate is not None:
            headers["tracestate"] = job.tracestate
    headers.update(options.get("headers") or {})
    if job.ordering_key is not None:
        headers[models.ORDERING_KEY_HEADER] = job.ordering_key
    properties["delivery_mode"] = PERSISTENT
    if expiration is not None:
        properties["expiration"] = expiration
    properties["priority"] = options.get("priority") or DEFAULT_PRIORITY
    return CeleryMessage(
        job=job,
        body=body,
        content_type=content_type,
        content_encoding=content_encoding,
        headers=headers,
        properties=properties,
        routing_key=job.queue,
    )


def _probe_jobs(maxsize: int) -> list[models.StagedJob]:
    """Rows covering each option, the trace context, an ordering key, empty, nested, quoted,
    non-ASCII and over-long arguments."""
    created = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    long_text = "a b'" * maxsize
    rows: list[tuple[list[Any], dict[str, Any], dict[str, Any], dict[str, Any]]] = [
        (["x" * 150], {}, {}, {}),
        ([], {}, {}, {}),
        ([1, -2.5, True, None, "it's", "é\u2028\n\x00"], {"k": [1, [2, [3, [4, {"d": 5}]]]]}, {}, {}),
        ([{"a": {"b": {"c": {"d": []}}}}, [], {}], {"n": 12345678901234567890, "f": 1e300}, {}, {}),
        ([long_text], {"long": long_text}, {}, {}),
        ([list(range(maxsize))], {str(n): n for n in range(maxsize)}, {}, {}),
        (
            [1],
            {"x": 1},
            {
                "priority": 5,
                "expires": 600,
                "time_limit": 30,
                "soft_time_limit": 20.5,
                "headers": {"tenant": "acme", "trace": [1, 2]},
                "retries": 2,
                "ignore_result": True,
                "shadow": "probe-shadow",
            },
            {},
        ),
        ([], {}, {"expires": "2030-01-01T00:00:00+02:00", "ignore_result": False, "retries": 0}, {}),
        (
            [],
            {},
            {"headers": {"traceparent": "mine"}},
            {
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "tracestate": "k=v",
                "ordering_key": "key-1",
            },
        ),
    ]
    return [
        models.StagedJob(
            id=n,
            job_id=uuid.UUID(int=n),
            job_name="drain.probe",
            args=args,
            kwargs=kwargs,
            queue="drain-probe",
            backend="probe",
            options=options,
            created_at=created,
            **extra,
        )
        for n, (args, kwargs, options, extra) in enumerate(rows, 1)
    ]


def _dict_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    if list(mine) != list(theirs):
        return f"keys {list(mine)} against Celery's {list(theirs)}"
    for key, value in mine.items():
        if value != theirs[key] or repr(value) != repr(theirs[key]):
            return f"{key} {repr(value)[:200]} against Celery's {repr(theirs[key])[:200]}"
    return "?"


def difference(ours: CeleryMessage, celerys: CeleryMessage) -> str | None:
    """What differs between two messages (keys in order, ``30`` against ``30.0``), or None."""
    for field in (
        "body",
        "content_type",
        "content_encoding",
        "headers",
        "properties",
        "routing_key",
        "exchange",
    ):
        mine, theirs = getattr(ours, field), getattr(celerys, field)
        if mine != theirs or repr(mine) != repr(theirs):
            if isinstance(mine, dict) and isinstance(theirs, dict):
                return f"{field}: {_dict_difference(mine, theirs)}"
            return f"{field}: {repr(mine)[:200]} against Celery's {repr(theirs)[:200]}"
    return None


def probe(app: celery.Celery) -> str | None:
    """None when the drain's own builder makes the messages ``as_task_v2`` and kombu make for
    the probe rows with this app (this Celery, this kombu, this configuration); else the first
    difference, and the caller keeps Celery's builder."""
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    try:
        protocol = Protocol2.of(app)
        for job in _probe_jobs(protocol.args_maxsize):
            ours = build(app, job, reply_to="probe", now=now, protocol=protocol)
            celerys = build(app, job, reply_to="probe", now=now)
            found = difference(ours, celerys)
            if found:
                return f"probe row {job.id}: {found}"
    except Exception as exc:  # noqa: BLE001 - builders failing on the probe: keep Celery's
        return f"the probe failed: {exc!r}"
    return None
