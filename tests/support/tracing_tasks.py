"""What the tracing tests' workers run: each run records the trace context it was handed.

A row of the ``deliveries`` table per run, its ``kwargs`` holding what the worker saw: the raw
``traceparent`` it was given (RQ: the job's meta; Celery: ``task.request.traceparent``; pika: the
message header) and the trace id and parent span id of the span the worker's code runs in.
The RQ function starts that span itself from :func:`drain.observability.tracing.context_from_rq_job`; the
Celery worker (``tests.support.tracing_celery``) and the pika consumer get theirs from the
OpenTelemetry instrumentation of Celery and pika. Each process traces with an SDK tracer
provider and no exporter: the spans only need to exist in the worker.
"""

from __future__ import annotations

import json
import os
from typing import Any

import psycopg
import rq
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from drain.observability import tracing
from tests.support import tasks

PROVIDER = TracerProvider()
CELERY_TASK = "tests.celery.traced"  # the task of tests.support.tracing_celery (not imported here)


def seen(traceparent: object, span: Any) -> dict[str, Any]:
    """What a worker saw: the raw traceparent and the ids of the span its code runs in."""
    context = span.get_span_context()
    parent = getattr(span, "parent", None)
    return {
        "traceparent": traceparent,
        "trace_id": format(context.trace_id, "032x") if context.is_valid else None,
        "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
    }


def record(job_id: str, job_name: str, what: dict[str, Any]) -> None:
    with psycopg.connect(os.environ[tasks.DSN_VARIABLE], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO deliveries (job_id, job_name, args, kwargs, worker) VALUES (%s, %s, '[]', %s, %s)",
            (job_id, job_name, json.dumps(what), os.getpid()),
        )


def rq_traced(*args: Any, **kwargs: Any) -> None:
    """An RQ job: its span starts from the context drain put in the job's meta."""
    job = rq.get_current_job()
    assert job is not None
    tracer = PROVIDER.get_tracer("tests.rq-worker")
    with tracer.start_as_current_span("rq work", context=tracing.context_from_rq_job(job)):
        record(job.id, job.func_name, seen(job.meta.get("traceparent"), trace.get_current_span()))
