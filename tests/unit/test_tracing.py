"""drain.observability.tracing without a database: the W3C checks, the core taking the reserved keys out of a
row's options (any options, never a crash, a malformed value never a rejection), stage() inside
and outside an active span, the adapters' carriers, and the drain's own forward span."""

from __future__ import annotations

import datetime
import json
import logging
import pickle
import subprocess
import sys
import uuid
import zlib
from collections.abc import Mapping
from typing import Any

import pika.spec
import pytest
from drain_adapters import rq as rq_adapter
from drain_adapters.celery import message as celery_message
from drain_adapters.rabbitmq import messages as rabbitmq_messages
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from drain import backend, models, testing
from drain.observability import metrics, tracing
from drain.relay import failpoints, forward
from drain.staging import rows as staging_rows
from drain.staging import sync as staging

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
PARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"
STATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)

provider = TracerProvider()
tracer = provider.get_tracer("tests.unit")


def staged(options: Mapping[str, Any], row_id: int = 7, job_name: str = "app.tasks.send") -> models.StagedJob:
    """A row as the store builds it: the reserved keys taken out of its options."""
    rest, traceparent, tracestate = tracing.split(options, row_id, "job")
    return models.StagedJob(
        id=row_id,
        job_id=uuid.uuid4(),
        job_name=job_name,
        args=[1],
        kwargs={},
        queue="q",
        backend="default",
        options=rest,
        created_at=NOW,
        traceparent=traceparent,
        tracestate=tracestate,
    )


# --- the W3C checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (PARENT, True),
        (f"00-{TRACE_ID}-{SPAN_ID}-00", True),
        (f"01-{TRACE_ID}-{SPAN_ID}-01-future-field", True),  # a later version may append fields
        (f"00-{TRACE_ID}-{SPAN_ID}-01-extra", False),  # version 00 is exactly 55 characters
        (f"ff-{TRACE_ID}-{SPAN_ID}-01", False),
        (f"00-{TRACE_ID.upper()}-{SPAN_ID}-01", False),
        (f"00-{'0' * 32}-{SPAN_ID}-01", False),
        (f"00-{TRACE_ID}-{'0' * 16}-01", False),
        (f"00-{TRACE_ID[:-1]}-{SPAN_ID}-01", False),
        (f"00-{TRACE_ID}-{SPAN_ID}-1", False),
        (f" {PARENT}", False),
        (f"{PARENT}\n", False),
        ("", False),
        (None, False),
        (17, False),
        ([PARENT], False),
        ({"traceparent": PARENT}, False),
    ],
)
def test_a_traceparent_is_the_w3c_format_with_nonzero_ids(value: object, valid: bool) -> None:
    assert tracing.valid_traceparent(value) is valid


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (STATE, True),
        ("a=1", True),
        ("tenant@system=v, other=w ,,", True),  # optional spaces, empty members
        ("k=" + "v" * 255, True),
        ("k=v" + ",k=v" * 31, True),  # 32 members
        ("k=v" + ",k=v" * 32, False),  # 33 members
        ("a=" + "b" * 510, False),  # 512 characters, but a value holds at most 256
        ("x" * 513, False),
        ("Upper=v", False),
        ("k=v=w", False),
        ("k=", False),
        ("=v", False),
        ("k=v\n", False),
        ("k=vé", False),
        ("k=v\x00", False),
        (None, False),
        (5, False),
    ],
)
def test_a_tracestate_is_a_bounded_printable_list_of_members(value: object, valid: bool) -> None:
    assert tracing.valid_tracestate(value) is valid


# --- the core takes the reserved keys out --------------------------------------------------------


def test_a_row_without_trace_keys_keeps_its_options_object() -> None:
    options = {"timeout": 5}
    assert tracing.split(options, 1, "j") == (options, None, None)
    assert tracing.split(options, 1, "j")[0] is options  # no copy on the common path


def test_the_reserved_keys_leave_the_options_and_valid_values_reach_the_job() -> None:
    job = staged({"traceparent": PARENT, "tracestate": STATE, "timeout": 5})
    assert (job.options, job.traceparent, job.tracestate) == ({"timeout": 5}, PARENT, STATE)


def test_a_malformed_value_is_dropped_with_one_warning_per_row_that_never_shows_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="drain.observability.tracing")
    row = 10**12 + uuid.uuid4().int % 10**6  # a row id no other test warned about
    for _ in range(3):  # the same row read again (retried): warned about once
        job = staged({"traceparent": "00-secret-value", "tracestate": STATE}, row_id=row)
        assert (job.options, job.traceparent, job.tracestate) == ({}, None, None)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1, warnings
    assert str(row) in warnings[0] and "secret" not in warnings[0]


def test_a_malformed_tracestate_is_dropped_and_the_traceparent_kept() -> None:
    job = staged({"traceparent": PARENT, "tracestate": "Not Valid"})
    assert (job.traceparent, job.tracestate) == (PARENT, None)


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=80)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
trace_values = st.one_of(
    json_values,
    st.just(PARENT),
    st.from_regex(r"[0-9a-fA-F]{2}-[0-9a-f]{30,34}-[0-9a-f]{15,17}-[0-9a-f]{1,3}", fullmatch=True),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x7F), max_size=600),
)
options_with_trace = st.builds(
    lambda rest, parent, state: {
        **rest,
        **({} if parent is None else {"traceparent": parent}),
        **({} if state is None else {"tracestate": state}),
    },
    st.dictionaries(st.text(max_size=12), json_values, max_size=4),
    st.none() | trace_values,
    st.none() | trace_values,
)


@settings(max_examples=300, deadline=None)
@given(options_with_trace)
def test_any_options_never_crash_the_core_and_only_valid_context_passes(options: dict[str, Any]) -> None:
    rest, traceparent, tracestate = tracing.split(options, 1, "j")
    assert dict(rest) == {k: v for k, v in options.items() if k not in tracing.RESERVED_OPTIONS}
    assert traceparent is None or (
        traceparent == options["traceparent"] and tracing.valid_traceparent(traceparent)
    )
    assert tracestate is None or (traceparent is not None and tracing.valid_tracestate(tracestate))


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_options_that_are_not_an_object_pass_through_untouched(options: Any) -> None:
    """The table's CHECK makes options an object; the core still never raises for anything else."""
    rest, traceparent, tracestate = tracing.split(options, 1, "j")
    assert (traceparent, tracestate) == (None, None)
    assert rest is options or isinstance(options, dict)


def rq_build(job: models.StagedJob) -> Any:
    the_adapter = rq_adapter.RQAdapter.from_options(
        "default", {"url": "redis://127.0.0.1:1/0", "allowed_jobs": ["app.tasks.send"]}, publish_timeout_s=5
    )
    return the_adapter.build(job, b"now")


def rabbitmq_build(job: models.StagedJob) -> Any:
    return rabbitmq_messages.build(job, max_body_bytes=1_000_000, frame_max=pika.spec.FRAME_MAX_SIZE)


def celery_build(job: models.StagedJob) -> Any:
    return celery_message.build(celery_message.new_app(), job, reply_to="r", now=NOW)


BUILDERS = {"rq": rq_build, "rabbitmq": rabbitmq_build, "celery": celery_build}


@pytest.mark.parametrize("backend_type", sorted(BUILDERS))
@settings(max_examples=150, deadline=None)
@given(parent=st.none() | trace_values, state=st.none() | trace_values)
def test_trace_keys_of_any_value_never_cost_a_job_its_delivery(
    backend_type: str, parent: Any, state: Any
) -> None:
    """Every backend refuses unknown options; the trace keys are never seen by it as options."""
    options = {"traceparent": parent, "tracestate": state}
    built, rejected = backend.build_each([staged(options)], BUILDERS[backend_type], "default")
    assert not rejected, rejected
    assert len(built) == 1


# --- the adapters' carriers ----------------------------------------------------------------------


def test_rq_puts_the_context_in_the_job_meta_where_a_worker_reads_it() -> None:
    message = rq_build(staged({"traceparent": PARENT, "tracestate": STATE, "meta": {"tenant": 3}}))
    meta = pickle.loads(message.fields[b"meta"])
    assert meta == {"traceparent": PARENT, "tracestate": STATE, "tenant": 3}
    assert pickle.loads(zlib.decompress(message.fields[b"data"]))[0] == "app.tasks.send"

    class Job:
        pass

    job = Job()
    job.meta = meta  # type: ignore[attr-defined]
    span_context = trace.get_current_span(tracing.context_from_rq_job(job)).get_span_context()
    assert (format(span_context.trace_id, "032x"), format(span_context.span_id, "016x")) == (
        TRACE_ID,
        SPAN_ID,
    )


def test_extract_reads_the_w3c_keys_of_any_carrier_and_nothing_of_none() -> None:
    context = trace.get_current_span(tracing.extract({"traceparent": PARENT, "x": 1})).get_span_context()
    assert format(context.trace_id, "032x") == TRACE_ID
    for carrier in (None, {}, {"traceparent": "bad"}, {"traceparent": 5}):
        assert not trace.get_current_span(tracing.extract(carrier)).get_span_context().is_valid


def test_rq_meta_set_by_the_row_wins_and_no_context_writes_no_meta() -> None:
    other = f"00-{'1' * 32}-{'2' * 16}-01"
    meta = pickle.loads(
        rq_build(staged({"traceparent": PARENT, "meta": {"traceparent": other}})).fields[b"meta"]
    )
    assert meta == {"traceparent": other}
    assert b"meta" not in rq_build(staged({})).fields


def test_rabbitmq_carries_the_context_in_the_amqp_headers() -> None:
    message = rabbitmq_build(staged({"traceparent": PARENT, "tracestate": STATE, "headers": {"x": 1}}))
    assert message.properties.headers == {"traceparent": PARENT, "tracestate": STATE, "x": 1}
    assert json.loads(message.body)["options"] == {"headers": {"x": 1}}
    assert rabbitmq_build(staged({})).properties.headers is None


def test_rabbitmq_sends_without_the_context_rather_than_refuse_headers_that_only_it_overflows() -> None:
    """Headers that fit one frame alone, but not with the trace context: sent without it."""
    frame_max = 4096
    filler = {"f": "x" * 3_900}
    job = staged({"traceparent": PARENT, "tracestate": "k=" + "v" * 255, "headers": filler})
    message = rabbitmq_messages.build(job, max_body_bytes=1_000_000, frame_max=frame_max)
    assert message.properties.headers == filler


def test_celery_carries_the_context_in_the_message_headers() -> None:
    message = celery_build(staged({"traceparent": PARENT, "tracestate": STATE}))
    assert (message.headers["traceparent"], message.headers["tracestate"]) == (PARENT, STATE)
    own = celery_build(staged({"traceparent": PARENT, "headers": {"traceparent": "mine"}}))
    assert own.headers["traceparent"] == "mine"
    assert "traceparent" not in celery_build(staged({})).headers


# --- stage() ----------------------------------------------------------------------------------------


def staged_options(job: staging_rows.Job) -> dict[str, Any]:
    params, _ = staging_rows.row(job)
    options: dict[str, Any] = json.loads(params["options"])
    return options


def test_stage_inside_an_active_span_records_its_traceparent() -> None:
    with tracer.start_as_current_span("request") as span:
        options = staged_options(staging.Job("app.tasks.send", options={"priority": 2}))
        ids, (chunk,) = staging.prepare_many([{"job_name": "app.tasks.send"}], ignore=False)
    context = span.get_span_context()
    assert options == {
        "priority": 2,
        "traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}",
    }
    assert json.loads(chunk.jobs)[0]["options"]["traceparent"] == options["traceparent"]  # stage_many too
    assert len(ids) == 1


def test_the_callers_traceparent_wins_over_the_current_span() -> None:
    with tracer.start_as_current_span("request"):
        options = staged_options(staging.Job("app.tasks.send", options={"traceparent": PARENT}))
    assert options == {"traceparent": PARENT}


def test_stage_without_an_active_span_records_none() -> None:
    assert staged_options(staging.Job("app.tasks.send")) == {}
    with tracer.start_as_current_span("ended"):
        pass
    assert staged_options(staging.Job("app.tasks.send", options={"timeout": 1})) == {"timeout": 1}


def test_stage_looks_for_no_span_while_the_app_has_not_loaded_opentelemetry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with tracer.start_as_current_span("request"):
        monkeypatch.delitem(sys.modules, "opentelemetry.trace")
        assert staged_options(staging.Job("app.tasks.send")) == {}


def test_importing_drain_and_staging_import_no_opentelemetry() -> None:
    code = (
        "import sys, drain, drain.store.session, drain.relay.loop\n"
        "from drain.staging import rows as staging_rows\n"
        "staging_rows.row(staging_rows.Job('app.tasks.send'))\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# --- the drain's own span --------------------------------------------------------------------------


def test_without_an_sdk_provider_the_drain_makes_no_span() -> None:
    code = (
        "from opentelemetry import trace\nfrom drain.observability import tracing\nprint(tracing._tracer())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "None"


def test_the_forward_of_a_batch_is_a_span_per_backend_linked_to_the_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()
    spans_provider = TracerProvider()
    spans_provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", lambda: spans_provider.get_tracer("drain"))
    the_gate = forward.Forwarder(
        {"default": testing.MemoryAdapter("default")},
        metrics_=metrics.Metrics(),
        failpoints_=failpoints.Failpoints(),
        clock=lambda: 0.0,
        rand=lambda: 0.5,
    )
    many = tracing.MAX_SPAN_LINKS + 5
    jobs = [staged({"traceparent": f"00-{n + 1:032x}-{SPAN_ID}-01"}, row_id=n) for n in range(many)]
    jobs.append(staged({}, row_id=many))
    results, _ = the_gate.forward(jobs, submit=False)
    assert len(results) == many + 1

    (span,) = exporter.get_finished_spans()
    assert span.name == "drain forward default"
    assert span.attributes is not None and span.attributes["messaging.batch.message_count"] == many + 1
    linked = [link.context.trace_id for link in span.links]
    assert linked == list(range(1, tracing.MAX_SPAN_LINKS + 1))  # capped, in row order


def test_workers_import_the_helpers_at_the_name_documented_since_0_1() -> None:
    """A worker written against 0.1 (docs/tracing.md) keeps working: drain.tracing.extract and
    drain.tracing.context_from_rq_job are the same functions as the ones the drain uses."""
    import drain.tracing

    assert drain.tracing.extract is tracing.extract
    assert drain.tracing.context_from_rq_job is tracing.context_from_rq_job
