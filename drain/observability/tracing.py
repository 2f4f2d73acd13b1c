"""W3C trace context from the staging transaction to the worker; OpenTelemetry is optional.

A row carries the trace context of the code that staged it in two reserved keys of its
``options`` object, ``traceparent`` and ``tracestate`` (the W3C Trace Context header names), so
no column and no migration is needed and a plain-SQL stager can set them too:

- :func:`drain.stage` and its siblings add them (:func:`with_current_context`) when the app has
  OpenTelemetry loaded and a valid span is current; a ``traceparent`` in the caller's options wins.
- The drain takes them out of the options when it reads a row (:func:`split`), before any
  adapter validates its own options, and hands them on as ``StagedJob.traceparent`` and
  ``StagedJob.tracestate``. A malformed value is dropped with a warning (once per row, never the
  value) and the job is delivered without it: trace context never blocks or rejects a job.
- Each adapter puts them where the consumer's instrumentation looks: AMQP message headers
  (RabbitMQ), the task message headers (Celery: ``task.request.traceparent``), the job's
  ``meta`` (RQ; :func:`context_from_rq_job` for a worker).

Nothing here imports OpenTelemetry at import time, and staging only looks for it when the app
has imported ``opentelemetry.trace`` itself (there can be no current span otherwise).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from drain import models

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
RESERVED_OPTIONS = (TRACEPARENT, TRACESTATE)
MAX_TRACESTATE_CHARS = 512  # W3C: a platform must propagate at least 512 characters
MAX_TRACESTATE_MEMBERS = 32  # W3C's limit on list-members
MAX_SPAN_LINKS = 128  # links on the drain's own forward span, one per job up to this many
MAX_WARNED_ROWS = 10_000  # rows remembered as already warned about (then the memory starts over)

# version 00 is 55 characters; a later version may append "-..." fields, which a 00 parser ignores.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[ -~]*)?")
_ZERO_TRACE_ID = "0" * 32
_ZERO_SPAN_ID = "0" * 16
# A list-member: key "=" value, key lowercase (with an optional tenant "@"), value printable ASCII
# without "," and "=", not ending in a space. Empty members (",,") are allowed by the spec.
_MEMBER = re.compile(
    r"[a-z0-9][a-z0-9_\-*/]{0,255}(@[a-z][a-z0-9_\-*/]{0,13})?=[!-+\--<>-~ ]{0,255}[!-+\--<>-~]"
)

_warned: dict[int, None] = {}


def valid_traceparent(value: object) -> bool:
    """Whether ``value`` is a W3C ``traceparent``: ``00-<32 hex>-<16 hex>-<2 hex>``, lowercase,
    neither id all zeros, version not ``ff`` (a later version may append fields after a ``-``)."""
    if not isinstance(value, str) or len(value) > MAX_TRACESTATE_CHARS:
        return False
    found = _TRACEPARENT.fullmatch(value)
    if found is None:
        return False
    version, trace_id, span_id, _flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return False
    return trace_id != _ZERO_TRACE_ID and span_id != _ZERO_SPAN_ID


def valid_tracestate(value: object) -> bool:
    """Whether ``value`` is a W3C ``tracestate``: at most 512 printable ASCII characters, a
    comma-separated list of at most 32 ``key=value`` members (checked loosely, as the spec's
    grammar; empty members are allowed)."""
    if not isinstance(value, str) or len(value) > MAX_TRACESTATE_CHARS:
        return False
    if not value.isascii() or not value.isprintable():
        return False
    members = [member.strip(" \t") for member in value.split(",")]
    present = [member for member in members if member]
    if len(present) > MAX_TRACESTATE_MEMBERS:
        return False
    return all(_MEMBER.fullmatch(member) for member in present)


def split(
    options: Mapping[str, Any], row_id: int = 0, job_id: object = None
) -> tuple[Mapping[str, Any], str | None, str | None]:
    """``options`` without the reserved keys, and the valid ``traceparent`` and ``tracestate``.

    The common row has neither key and gets its options back as they are. A malformed value is
    dropped (a ``tracestate`` without a valid ``traceparent`` too) and logged once per row,
    naming the row and never the value. Never raises for any options value.
    """
    try:
        if TRACEPARENT not in options and TRACESTATE not in options:
            return options, None, None  # the common row: two lookups, no copy
    except TypeError:  # not a container at all
        return options, None, None
    if not isinstance(options, Mapping):
        return options, None, None
    rest = {key: value for key, value in options.items() if key not in RESERVED_OPTIONS}
    raw_parent, raw_state = options.get(TRACEPARENT), options.get(TRACESTATE)
    traceparent = raw_parent if valid_traceparent(raw_parent) else None
    tracestate = raw_state if traceparent is not None and valid_tracestate(raw_state) else None
    dropped = []
    if raw_parent is not None and traceparent is None:
        dropped.append(TRACEPARENT)
    if raw_state is not None and tracestate is None and (traceparent is not None or raw_parent is None):
        dropped.append(TRACESTATE)
    if dropped:
        _warn_once(row_id, job_id, dropped)
    return rest, traceparent, tracestate


def _warn_once(row_id: int, job_id: object, dropped: Sequence[str]) -> None:
    if row_id in _warned:
        return
    if len(_warned) >= MAX_WARNED_ROWS:
        _warned.clear()
    _warned[row_id] = None
    log.warning(
        "row %s (job %s): malformed %s option dropped; the job is forwarded without trace context",
        row_id,
        job_id,
        " and ".join(dropped),
    )


# --- staging --------------------------------------------------------------------------------


def with_current_context(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the current span's ``traceparent`` (and ``tracestate``) added, when the
    app uses OpenTelemetry and a valid span is current. A ``traceparent`` already in ``options``
    wins (its ``tracestate``, if any, stays as given). ``options`` itself is not changed."""
    if TRACEPARENT in options or "opentelemetry.trace" not in sys.modules:
        return options
    carrier = _current_carrier()
    traceparent = carrier.get(TRACEPARENT)
    if not traceparent:
        return options
    added = dict(options)
    added[TRACEPARENT] = traceparent
    tracestate = carrier.get(TRACESTATE)
    if tracestate:
        added[TRACESTATE] = tracestate
    else:
        added.pop(TRACESTATE, None)  # a tracestate belongs to its traceparent
    return added


def _current_carrier() -> dict[str, str]:
    """The W3C headers of the current OpenTelemetry context (empty without a valid span)."""
    carrier: dict[str, str] = {}
    try:
        _w3c().inject(carrier)
    except Exception:  # noqa: BLE001 - tracing must never fail a stage()
        return {}
    return carrier


@functools.cache
def _w3c() -> Any:
    """The W3C Trace Context propagator: the keys are W3C's whatever the app's global
    propagator is (B3, Jaeger, ...)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


# --- workers --------------------------------------------------------------------------------


def context_from_rq_job(job: Any) -> Context:
    """The OpenTelemetry context an RQ job was staged in (from its ``meta``), to start the
    worker's span with: ``tracer.start_as_current_span(name, context=context_from_rq_job(job))``.
    An empty context when the job carries none. Needs ``opentelemetry-api``."""
    return extract(getattr(job, "meta", None))


def extract(carrier: Mapping[str, Any] | None) -> Context:
    """The OpenTelemetry context of W3C ``traceparent``/``tracestate`` keys in ``carrier``
    (AMQP headers, RQ meta; None or a carrier without them: an empty context)."""
    if not isinstance(carrier, Mapping):
        carrier = {}
    headers = {key: carrier[key] for key in RESERVED_OPTIONS if isinstance(carrier.get(key), str)}
    context: Context = _w3c().extract(headers)
    return context


# --- the drain's own forward span -----------------------------------------------------------


def _tracer() -> Any:
    """The drain's tracer when this process has an OpenTelemetry SDK tracer provider (as
    ``opentelemetry-instrument drain run`` sets one up from the ``OTEL_*`` environment), else
    None. Without OpenTelemetry loaded this is one dictionary lookup: nothing is imported."""
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return provider.get_tracer("drain")


@contextlib.contextmanager
def forward_span(backend: str, jobs: Sequence[models.StagedJob]) -> Iterator[None]:
    """A span around one backend's share of a batch, linked to the jobs' staging contexts (at
    most MAX_SPAN_LINKS), when the drain process has an OpenTelemetry SDK configured."""
    tracer = _tracer()
    if tracer is None:
        yield
        return
    yield from _spanned(tracer, backend, jobs)


def _spanned(tracer: Any, backend: str, jobs: Sequence[models.StagedJob]) -> Iterator[None]:
    from opentelemetry import trace

    links = []
    for job in jobs:
        if job.traceparent is None:
            continue
        context = trace.get_current_span(extract({TRACEPARENT: job.traceparent})).get_span_context()
        if context.is_valid:
            links.append(trace.Link(context))
            if len(links) >= MAX_SPAN_LINKS:
                break
    attributes = {
        "messaging.system": "drain",
        "drain.backend": backend,
        "messaging.batch.message_count": len(jobs),
    }
    with tracer.start_as_current_span(
        f"drain forward {backend}", kind=trace.SpanKind.PRODUCER, links=links, attributes=attributes
    ):
        yield
