"""Trace context from the staging transaction to real workers: a job staged inside an active span
arrives at a real ``rq worker``, a pika consumer and a real ``celery worker`` with the same trace
id, and the span the worker's code runs in is a child of the span that staged it.

The test process traces with an SDK tracer provider of its own (not installed globally); stage()
records the current span's context whatever provider made it. The workers trace with their own
providers (tests.support.tracing_tasks): the RQ job through drain.observability.tracing.context_from_rq_job,
Celery and pika through their OpenTelemetry instrumentations, unmodified.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.instrumentation.pika import PikaInstrumentor
from opentelemetry.sdk.trace import TracerProvider

import drain
from drain import testing
from drain.relay import loop as relay
from drain.store import admin
from tests.support import celery_rig, configs, ledger, processes, rabbit, tracing_tasks
from tests.support.waiting import wait_until

RQ_JOB = "tests.support.tracing_tasks.rq_traced"
DEADLINE_S = 60.0

provider = TracerProvider()
tracer = provider.get_tracer("tests.app")


def ids(span: Any) -> tuple[str, str]:
    context = span.get_span_context()
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def stage_in_span(dsn: str, job_name: str, queue: str, **options: Any) -> tuple[uuid.UUID, str, str]:
    """Stage one job inside an active span and commit; (job id, trace id, span id)."""
    with tracer.start_as_current_span("request") as span, psycopg.connect(dsn) as conn:
        job_id = drain.stage(conn, job_name, queue=queue, options=options or None)
        conn.commit()
        trace_id, span_id = ids(span)
    return job_id, trace_id, span_id


def delivered(dsn: str, job_id: uuid.UUID | str) -> dict[str, Any] | None:
    """What the worker recorded for ``job_id`` (None until it ran)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT kwargs FROM deliveries WHERE job_id = %s", (str(job_id),)).fetchone()
    return None if row is None else dict(row[0])


def wait_delivered(dsn: str, job_id: uuid.UUID | str, *logs: processes.Process) -> dict[str, Any]:
    try:
        seen: dict[str, Any] = wait_until(f"job {job_id}", lambda: delivered(dsn, job_id), DEADLINE_S)
    except AssertionError:
        raise AssertionError("\n".join(process.output()[-3000:] for process in logs)) from None
    return seen


def staged_options(dsn: str, job_id: uuid.UUID) -> dict[str, Any]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT options FROM staged_jobs WHERE job_id = %s", (job_id,)).fetchone()
    assert row is not None
    return dict(row[0])


# --- RQ -----------------------------------------------------------------------------------------


@pytest.fixture
def rq_rig(database: str, redis_db: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A queue of the test's own with one real ``rq worker``, and a drain config for it."""
    ledger.install(database)
    queue = rabbit.unique_name("tracing")
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rq(redis_db, [RQ_JOB])}
    )
    worker = processes.start_workers(redis_db, queue, database, tmp_path, count=1)
    with processes.running(*worker):
        yield queue, config


def test_a_job_staged_in_a_span_reaches_a_real_rq_worker_in_the_same_trace(
    rq_rig: tuple[str, Path], database: str, tmp_path: Path
) -> None:
    queue, config = rq_rig
    job_id, trace_id, span_id = stage_in_span(database, RQ_JOB, queue)
    assert staged_options(database, job_id)["traceparent"].split("-")[1:3] == [trace_id, span_id]

    drain_process = processes.start_drain(config, database, tmp_path / "drain.log")
    with processes.running(drain_process):
        seen = wait_delivered(database, job_id, drain_process)

    assert seen["traceparent"].split("-")[1] == trace_id, seen  # the job's meta
    assert seen["trace_id"] == trace_id, seen  # the worker's span: the same trace ...
    assert seen["parent_span_id"] == span_id, seen  # ... a child of the span that staged it


def test_plain_sql_staging_sets_the_trace_with_the_option_key_and_a_bad_one_never_blocks_the_job(
    rq_rig: tuple[str, Path], database: str, tmp_path: Path
) -> None:
    """The README's INSERT: ``options`` ``{"traceparent": ...}``; a malformed value is dropped
    with one warning naming the row, and its job runs all the same."""
    queue, config = rq_rig
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    good, bad = uuid.uuid4(), uuid.uuid4()
    with psycopg.connect(database) as conn:
        for job_id, traceparent in ((good, f"00-{trace_id}-{span_id}-01"), (bad, "00-not-a-trace-01")):
            conn.execute(
                "INSERT INTO staged_jobs (job_name, job_args, queue, backend, job_id, options) "
                "VALUES (%s, '[]', %s, 'default', %s, %s)",
                (RQ_JOB, queue, job_id, json.dumps({"traceparent": traceparent, "tracestate": "vendor=x"})),
            )

    drain_process = processes.start_drain(config, database, tmp_path / "drain.log")
    with processes.running(drain_process):
        seen_good = wait_delivered(database, good, drain_process)
        seen_bad = wait_delivered(database, bad, drain_process)

    assert (seen_good["trace_id"], seen_good["parent_span_id"]) == (trace_id, span_id), seen_good
    assert seen_bad["traceparent"] is None and seen_bad["parent_span_id"] is None, seen_bad
    warnings = [line for line in drain_process.output().splitlines() if "malformed traceparent" in line]
    assert len(warnings) == 1 and str(bad) in warnings[0], warnings
    assert "not-a-trace" not in drain_process.output()  # the value itself is never logged


# --- dead letters ------------------------------------------------------------------------------


def test_the_trace_context_survives_dead_lettering_and_dead_retry(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    """The keys live in the row's options, so they move with it into the dead-letter table and
    back (`drain dead retry`), and reach the backend when it is finally forwarded."""
    memory.behaviour = lambda job: "reject"
    job_id, trace_id, span_id = stage_in_span(database, "app.poison", "q")

    def dead() -> bool:
        leader.drain_once()
        return bool(admin.Admin(leader.store.conn, leader.store.names).dead_list(admin.DeadFilter()))

    wait_until("the job to be dead-lettered", dead, DEADLINE_S)
    assert admin.Admin(leader.store.conn, leader.store.names).dead_retry(admin.DeadFilter()).done == 1
    memory.behaviour = lambda job: "ack"
    wait_until("the retried job", lambda: leader.drain_once().published, DEADLINE_S)

    (job,) = memory.published
    assert job.job_id == job_id and job.options == {}
    assert job.traceparent is not None and job.traceparent.split("-")[1:3] == [trace_id, span_id]


# --- RabbitMQ, read by a pika consumer ----------------------------------------------------------


class TracedConsumer:
    """A real pika consumer, its channel instrumented by opentelemetry-instrumentation-pika;
    records, per message id, the header and the span the callback runs in."""

    def __init__(self, url: str, queue: str) -> None:
        self.url, self.queue = url, queue
        self.seen: dict[str, dict[str, Any]] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traced-consumer", daemon=True)

    def __enter__(self) -> TracedConsumer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        try:
            connection = pika.BlockingConnection(pika.URLParameters(self.url))
            channel = connection.channel()

            def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
                span = trace.get_current_span()
                context = span.get_span_context()
                parent = getattr(span, "parent", None)
                self.seen[str(properties.message_id)] = {
                    "traceparent": (properties.headers or {}).get("traceparent"),
                    "trace_id": format(context.trace_id, "032x") if context.is_valid else None,
                    "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
                    "options": json.loads(body)["options"],
                }
                ch.basic_ack(method.delivery_tag)

            channel.basic_consume(self.queue, on_message)
            PikaInstrumentor.instrument_channel(channel, tracer_provider=provider)
            while not self._stop.is_set():
                connection.process_data_events(time_limit=0.2)
            connection.close()
        except BaseException as exc:
            self.error = exc


def test_a_job_staged_in_a_span_reaches_a_pika_consumer_in_the_same_trace(
    database: str, tmp_path: Path
) -> None:
    rabbit.need_rabbitmq()
    queue = rabbit.unique_name("tracing")
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rabbitmq(rabbit.SHARED_URL)}
    )
    with rabbit.queues(rabbit.SHARED_URL, queue), TracedConsumer(rabbit.SHARED_URL, queue) as consumer:
        job_id, trace_id, span_id = stage_in_span(database, "app.tasks.traced", queue, priority=3)
        drain_process = processes.start_drain(config, database, tmp_path / "drain.log")
        with processes.running(drain_process):
            seen = wait_until(
                "the pika consumer", lambda: consumer.error or consumer.seen.get(str(job_id)), DEADLINE_S
            )
    assert not isinstance(seen, BaseException), seen

    assert seen["traceparent"].split("-")[1:3] == [trace_id, span_id], seen  # the AMQP header
    assert (seen["trace_id"], seen["parent_span_id"]) == (trace_id, span_id), seen  # pika's span
    assert seen["options"] == {"priority": 3}, seen  # the reserved keys left the options


# --- the drain's own span, in a real drain process ------------------------------------------------


def console_spans(output: str) -> list[dict[str, Any]]:
    """The spans the SDK's console exporter printed (one indented JSON object each)."""
    decoder = json.JSONDecoder()
    spans = []
    for start in (index for index, line in enumerate(output.split("\n")) if line == "{"):
        offset = sum(len(line) + 1 for line in output.split("\n")[:start])
        spans.append(decoder.raw_decode(output, offset)[0])
    return spans


def test_the_drain_forward_is_a_span_linked_to_the_staging_span_and_the_job_keeps_its_trace(
    database: str, tmp_path: Path
) -> None:
    """``opentelemetry-instrument drain run`` (the SDK from the OTEL_* environment, a console
    exporter): a ``drain forward`` span links to the staging span, and the pika consumer still
    runs in the staging trace (the pika instrumentation is off in the drain, as the README says)."""
    rabbit.need_rabbitmq()
    queue = rabbit.unique_name("tracing")
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rabbitmq(rabbit.SHARED_URL)}
    )
    env = {
        "DRAIN_CONFIG": str(config),  # opentelemetry-instrument would take --config for its own
        "OTEL_SERVICE_NAME": "drain",
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "pika",
    }
    command = [str(processes.BIN / "opentelemetry-instrument"), processes.DRAIN, "run"]
    with rabbit.queues(rabbit.SHARED_URL, queue), TracedConsumer(rabbit.SHARED_URL, queue) as consumer:
        job_id, trace_id, span_id = stage_in_span(database, "app.tasks.traced", queue)
        drain_process = processes.Process(
            command, processes.environment(database, env), tmp_path / "drain.log"
        )
        with processes.running(drain_process):
            seen = wait_until(
                "the pika consumer", lambda: consumer.error or consumer.seen.get(str(job_id)), DEADLINE_S
            )
        # stopped: the SDK flushed its spans on the way out
    assert not isinstance(seen, BaseException), seen
    assert (seen["trace_id"], seen["parent_span_id"]) == (trace_id, span_id), seen

    forwards = [
        span for span in console_spans(drain_process.output()) if span["name"] == "drain forward default"
    ]
    links = [link["context"] for span in forwards for link in span["links"]]
    assert {"trace_id": f"0x{trace_id}", "span_id": f"0x{span_id}"}.items() <= links[0].items(), forwards
    assert (
        forwards[0]["kind"] == "SpanKind.PRODUCER" and forwards[0]["context"]["trace_id"] != f"0x{trace_id}"
    )


# --- Celery ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("broker", ["rabbitmq", "redis"])
def test_a_job_staged_in_a_span_reaches_a_real_celery_worker_in_the_same_trace(
    broker: str, database: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if broker == "rabbitmq":
        rabbit.need_rabbitmq()
        broker_url = rabbit.SHARED_URL
    else:
        broker_url = request.getfixturevalue("redis_db")
    ledger.install(database)
    queue = rabbit.unique_name("celery-tracing")
    worker = celery_rig.start_worker(
        broker_url, queue, database, tmp_path / "worker.log", app="tests.support.tracing_celery"
    )
    config = celery_rig.write_config(
        tmp_path / "drain.toml", database, broker_url, allowed_jobs=[tracing_tasks.CELERY_TASK]
    )
    try:
        with processes.running(worker):
            celery_rig.wait_ready(worker)
            job_id, trace_id, span_id = stage_in_span(database, tracing_tasks.CELERY_TASK, queue)
            drain_process = processes.start_drain(config, database, tmp_path / "drain.log")
            with processes.running(drain_process):
                seen = wait_delivered(database, job_id, drain_process, worker)
    finally:
        celery_rig.forget_queue(broker_url, queue)

    assert seen["traceparent"].split("-")[1:3] == [trace_id, span_id], seen  # task.request.traceparent
    assert (seen["trace_id"], seen["parent_span_id"]) == (trace_id, span_id), seen  # Celery's span
