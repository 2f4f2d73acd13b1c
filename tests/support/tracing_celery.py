"""The Celery app of the tracing tests (``celery -A tests.support.tracing_celery worker``): Celery's
OpenTelemetry instrumentation on an SDK tracer provider, and one task that records the trace
context its span runs in (``tests.support.tracing_tasks.record``). Only the worker imports it: it
sets the process's global tracer provider and instruments Celery. The broker comes through
``DRAIN_TEST_CELERY_BROKER``, the deliveries database through ``DRAIN_TEST_DELIVERIES_DSN``."""

from __future__ import annotations

import os
from typing import Any

import celery
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor

from tests.support import celery_tasks, tracing_tasks

app = celery.Celery(
    "drain_tracing_tests",
    broker=os.environ.get(celery_tasks.BROKER_VARIABLE, "memory://"),
    set_as_current=False,
)
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    worker_enable_remote_control=False,
    worker_send_task_events=False,
    broker_connection_retry_on_startup=True,
)
trace.set_tracer_provider(tracing_tasks.PROVIDER)
CeleryInstrumentor().instrument(tracer_provider=tracing_tasks.PROVIDER)


@app.task(name=tracing_tasks.CELERY_TASK, bind=True)
def traced(self: Any, *args: Any, **kwargs: Any) -> None:
    """Record the raw header and the span the instrumentation started for this run."""
    what = tracing_tasks.seen(getattr(self.request, "traceparent", None), trace.get_current_span())
    tracing_tasks.record(self.request.id, self.name, what)
