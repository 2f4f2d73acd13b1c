"""Building RabbitMQ messages from rows, with no broker: every row either becomes a message that
pika's own encoder writes (method and header frames, one frame each) or is refused with a reason.
Nothing else may escape ``build``: another exception would be caught by ``build_each``'s net, but
would mean validation missed a case the broker or pika refuses."""

from __future__ import annotations

import datetime
import json
import math
import uuid
from typing import Any

import pika
import pika.frame
import pika.spec
import pytest
from drain_adapters.rabbitmq import messages as rabbitmq_messages
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from drain import backend, errors, models

FRAME_MAX = pika.spec.FRAME_MAX_SIZE
MAX_BODY = 1_000_000
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)

hostile_text = st.one_of(
    st.text(max_size=40),
    st.text(min_size=200, max_size=400),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=60, max_size=140),  # 2-4 bytes each
    st.sampled_from(["", "\x00", "a\x00b", "\ud800", "é" * 128, "é" * 127, "x" * 255, "x" * 256]),
)
big_ints = st.one_of(
    st.integers(),
    st.sampled_from([2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**70, 10**30]),
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    big_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    hostile_text,
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(hostile_text, children, max_size=4)
    ),
    max_leaves=12,
)
# Mostly plausible values with hostile ones mixed in, so that rows reach every check.
names = st.one_of(st.text(max_size=40), st.text(max_size=40), st.text(max_size=40), hostile_text)
headers = st.one_of(
    st.dictionaries(hostile_text, json_values, max_size=5),
    st.dictionaries(st.text(max_size=10), json_values, max_size=5),
    st.fixed_dictionaries({"CC": json_values}),
    st.fixed_dictionaries({"BCC": st.lists(hostile_text, max_size=3)}),
    json_values,
)
known_options = st.fixed_dictionaries(
    {},
    optional={
        "priority": st.one_of(st.integers(-5, 300), st.integers(0, 255), json_values),
        "expiration": st.one_of(
            st.integers(-5, 2**33),
            st.integers(0, 2**33).map(str),
            st.sampled_from(["", " 7", "-1", "1e3", "١٢", "²", "0" * 11, "4294967295", "4294967296"]),
            json_values,
        ),
        "headers": headers,
    },
)
options = st.one_of(
    known_options,
    known_options,
    known_options,
    st.fixed_dictionaries(
        {},
        optional={
            "priority": st.one_of(st.integers(-5, 300), json_values),
            "expiration": st.one_of(
                st.integers(-5, 2**33),
                st.integers(0, 2**33).map(str),
                st.sampled_from(["", " 7", "-1", "1e3", "١٢", "²", "0" * 11, "4294967295", "4294967296"]),
                json_values,
            ),
            "headers": st.one_of(
                st.dictionaries(hostile_text, json_values, max_size=5),
                st.fixed_dictionaries({"CC": json_values}),
                st.fixed_dictionaries({"BCC": st.lists(hostile_text, max_size=3)}),
                json_values,
            ),
            "ttl": json_values,
        },
    ),
)
created = st.one_of(
    st.datetimes(min_value=datetime.datetime(1970, 1, 2), timezones=st.just(datetime.UTC)),
    st.datetimes(
        min_value=datetime.datetime(1, 1, 2),
        max_value=datetime.datetime(9999, 12, 30),
        timezones=st.just(datetime.UTC),
    ),
)


def job(
    job_name: str = "app.tasks.x",
    queue: str = "q",
    args: Any = (),
    kwargs: Any = None,
    options_: Any = None,
    created_at: datetime.datetime = NOW,
) -> models.StagedJob:
    return models.StagedJob(
        1, uuid.uuid4(), job_name, list(args), kwargs or {}, queue, "events", options_ or {}, created_at
    )


def written(message: rabbitmq_messages.Message) -> pika.BasicProperties:
    """Marshal the frames ``basic_publish`` writes, as pika does; return the properties read back."""
    method = pika.spec.Basic.Publish(exchange="", routing_key=message.routing_key, mandatory=True)
    pika.frame.Method(1, method).marshal()
    header = pika.frame.Header(1, len(message.body), message.properties).marshal()
    assert len(header) <= FRAME_MAX, "the header frame exceeds frame_max: the broker closes the connection"
    frame_size = int.from_bytes(header[3:7], "big")
    decoded = pika.spec.BasicProperties()
    decoded.decode(header[7 + 12 : 7 + frame_size])
    return decoded


def refuse_constant(name: str) -> Any:
    raise AssertionError(f"the body holds {name}, which is not JSON")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    job_name=names,
    queue=names,
    args=st.lists(json_values, max_size=4),
    kwargs=st.dictionaries(st.text(max_size=10), json_values, max_size=4),
    options_=options,
    created_at=created,
)
@example(job_name="x" * 300, queue="q", args=[], kwargs={}, options_={}, created_at=NOW)
@example(job_name="x", queue="q" * 300, args=[], kwargs={}, options_={}, created_at=NOW)
@example(job_name="x", queue="q", args=[], kwargs={}, options_={"headers": {"a": 2**70}}, created_at=NOW)
@example(job_name="x", queue="q", args=[], kwargs={}, options_={"headers": {"k" * 300: 1}}, created_at=NOW)
@example(job_name="x", queue="q", args=[math.inf], kwargs={}, options_={}, created_at=NOW)
@example(
    job_name="x", queue="q", args=[], kwargs={}, options_={"headers": {"a": "x" * 140_000}}, created_at=NOW
)
def test_every_row_is_a_writable_message_or_a_refusal_with_a_reason(
    job_name: str,
    queue: str,
    args: list[Any],
    kwargs: dict[str, Any],
    options_: dict[str, Any],
    created_at: Any,
) -> None:
    row = job(job_name, queue, args, kwargs, options_, created_at)
    try:
        message = rabbitmq_messages.build(row, max_body_bytes=MAX_BODY, frame_max=FRAME_MAX)
    except errors.JobRefused as refused:
        assert str(refused).strip()
        built, rejected = backend.build_each(
            [row],
            lambda j: rabbitmq_messages.build(j, max_body_bytes=MAX_BODY, frame_max=FRAME_MAX),
            "rabbitmq",
        )
        assert not built
        assert [r.outcome for r in rejected] == [models.Outcome.REJECTED]
        assert (
            rejected[0].error and rejected[0].error.startswith("rabbitmq: ") and len(rejected[0].error) > 11
        )
        return
    decoded = written(message)
    assert message.routing_key == queue
    assert (decoded.type, decoded.message_id) == (job_name, str(row.job_id))
    assert decoded.headers == (options_.get("headers") if "headers" in options_ else None)
    assert len(message.body) <= MAX_BODY
    body = json.loads(message.body, parse_constant=refuse_constant)
    assert (body["job_name"], body["queue"], body["args"], body["kwargs"]) == (job_name, queue, args, kwargs)


@settings(max_examples=300, deadline=None)
@given(headers_=headers, priority=st.one_of(st.none(), st.integers(-1, 256)))
def test_any_headers_are_written_or_refused(headers_: Any, priority: int | None) -> None:
    opts = {"headers": headers_} if priority is None else {"headers": headers_, "priority": priority}
    row = job(options_=opts)
    try:
        message = rabbitmq_messages.build(row, max_body_bytes=MAX_BODY, frame_max=FRAME_MAX)
    except errors.JobRefused as refused:
        assert str(refused).strip()
        return
    assert written(message).headers == headers_


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        (job(job_name="x" * 256), "job_name (the AMQP type) is 256 bytes in UTF-8; AMQP allows 255"),
        (job(queue="é" * 128), "queue (the routing key) is 256 bytes"),
        (job(options_={"headers": {"n": 2**70}}), "headers.'n': an integer of 71 bits is outside signed 64"),
        (job(options_={"headers": {"n": [2**63]}}), "headers.'n'[0]: 9223372036854775808 is outside"),
        (job(options_={"headers": {"k" * 256: 1}}), "a key in headers is 256 bytes"),
        (job(options_={"headers": {"f": 1.5}}), "a float cannot be an AMQP header value"),
        (job(options_={"headers": {"CC": "q"}}), "header CC must be an array of queue names"),
        (job(options_={"headers": {"a": "x" * 140_000}}), "more than one AMQP frame"),
        (job(options_={"priority": 300}), "priority must be an integer 0-255, not 300"),
        (job(options_={"priority": True}), "priority must be an integer 0-255, not True"),
        (job(options_={"expiration": "soon"}), "expiration must be milliseconds 0-4294967295, not 'soon'"),
        (job(options_={"expiration": " 7"}), "expiration must be milliseconds"),
        (job(options_={"expiration": "²"}), "expiration must be milliseconds"),
        (job(options_={"expiration": 2**32}), "expiration must be milliseconds"),
        (job(options_={"expiration": -1}), "expiration must be milliseconds"),
        (job(options_={"ttl": 5}), "unknown RabbitMQ option(s) ttl"),
        (job(args=[math.inf]), "not valid JSON"),
        (job(kwargs={"n": math.nan}), "not valid JSON"),
        (job(created_at=EPOCH - datetime.timedelta(seconds=1)), "created_at is before 1970"),
        (job(job_name="a\x00b"), "contains a NUL"),
        (job(queue=""), "queue (the routing key) name is empty"),
        (job(queue="amq.gen-JzTY20BRgKO-HjmUJj0wLg"), "is reserved: amq. names are the broker's own"),
        (job(queue="amq.rabbitmq.reply-to"), "is reserved"),
        (job(options_={"headers": {"BCC": ["amq.rabbitmq.reply-to"]}}), "a queue in header BCC name"),
        (job(options_={"headers": {"CC": ["ok", ""]}}), "a queue in header CC name is empty"),
        (job(options_={"headers": {"CC": ["q" * 256]}}), "a queue in header CC is 256 bytes"),
        (job(options_={"headers": {"CC": ["\ud800"]}}), "not valid Unicode"),
        (job(queue="q\nx"), "contains a line break, which RabbitMQ strips"),  # no queue has it
        (job(queue="q\r"), "contains a line break"),
        (job(options_={"headers": {"CC": ["ok", "q\nx"]}}), "a queue in header CC name 'q\\nx' contains"),
    ],
)
def test_what_amqp_or_rabbitmq_refuses_is_refused_with_its_reason(row: models.StagedJob, reason: str) -> None:
    with pytest.raises(errors.JobRefused) as refused:
        rabbitmq_messages.build(row, max_body_bytes=MAX_BODY, frame_max=FRAME_MAX)
    assert reason in str(refused.value)


def test_a_line_break_routes_by_the_bindings_of_a_named_exchange() -> None:
    """A binding key keeps CR and LF (RabbitMQ strips them only from the names of queues and
    exchanges): on a named exchange such a routing key may match a binding, so it is sent."""
    message = rabbitmq_messages.build(
        job(queue="q\nx"), max_body_bytes=MAX_BODY, frame_max=FRAME_MAX, exchange="jobs"
    )
    assert message.routing_key == "q\nx"


def test_the_limits_are_inclusive_and_a_good_row_keeps_its_values() -> None:
    row = job(
        job_name="é" * 127 + "x",  # 255 bytes
        queue="q" * 255,
        options_={
            "priority": 255,
            "expiration": "4294967295",
            "headers": {"k" * 255: [2**63 - 1, -(2**63), None, True, {"deep": "ü"}], "CC": ["other"]},
        },
        created_at=EPOCH,
    )
    message = rabbitmq_messages.build(row, max_body_bytes=MAX_BODY, frame_max=FRAME_MAX)
    decoded = written(message)
    assert (decoded.priority, decoded.expiration, decoded.timestamp) == (255, "4294967295", 0)
    assert decoded.headers == row.options["headers"]
    assert (decoded.delivery_mode, decoded.content_type) == (2, "application/json")


def test_on_a_named_exchange_the_routing_key_is_no_queue_name() -> None:
    """Only the default exchange routes by queue name; a named one takes any short string."""
    row = job(queue="amq.anything", options_={"headers": {"CC": ["amq.other", ""]}})
    message = rabbitmq_messages.build(row, max_body_bytes=MAX_BODY, frame_max=FRAME_MAX, exchange="events")
    assert message.routing_key == "amq.anything"
    with pytest.raises(errors.JobRefused, match="is 256 bytes"):
        rabbitmq_messages.build(
            job(options_={"headers": {"CC": ["q" * 256]}}),
            max_body_bytes=MAX_BODY,
            frame_max=FRAME_MAX,
            exchange="events",
        )


def test_the_header_frame_size_is_kept_for_the_connections_frame_max() -> None:
    """``submit`` checks it again after connecting: a (re)connection may negotiate less."""
    plain = rabbitmq_messages.build(job(), max_body_bytes=MAX_BODY, frame_max=FRAME_MAX)
    assert 0 < plain.header_frame_bytes < 4096  # the smallest frame_max: no encoding needed
    headed = rabbitmq_messages.build(
        job(options_={"headers": {"a": "x" * 5000}}), max_body_bytes=MAX_BODY, frame_max=FRAME_MAX
    )
    assert headed.header_frame_bytes == len(
        pika.frame.Header(1, len(headed.body), headed.properties).marshal()
    )


def test_a_smaller_frame_max_refuses_smaller_headers() -> None:
    row = job(options_={"headers": {"a": "x" * 5000}})
    rabbitmq_messages.build(row, max_body_bytes=MAX_BODY, frame_max=FRAME_MAX)
    with pytest.raises(errors.JobRefused, match="frame_max 4096"):
        rabbitmq_messages.build(row, max_body_bytes=MAX_BODY, frame_max=4096)


def test_a_body_over_max_message_bytes_is_refused() -> None:
    row = job(args=["x" * 500])
    with pytest.raises(errors.JobRefused, match="exceeds max_message_bytes"):
        rabbitmq_messages.build(row, max_body_bytes=400, frame_max=FRAME_MAX)
