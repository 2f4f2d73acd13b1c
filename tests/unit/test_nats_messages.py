"""The NATS backend's message (drain_adapters.nats.messages) and settings: what a row becomes on
the wire, and that no value a row can hold adds a header line or a protocol field of its own."""

from __future__ import annotations

import dataclasses
import datetime
import json
import uuid
from typing import Any

import pytest
from drain_adapters.nats import messages
from drain_adapters.nats import settings as nats_settings
from hypothesis import given, settings
from hypothesis import strategies as st

from drain import errors, models

MAX_PAYLOAD = 1_048_576


def job(**changes: Any) -> models.StagedJob:
    base = models.StagedJob(
        id=1,
        job_id=uuid.uuid4(),
        job_name="app.tasks.send",
        args=[1, "two"],
        kwargs={"three": 3},
        queue="email",
        backend="default",
        options={},
        created_at=datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
    )
    return dataclasses.replace(base, **changes)


def header_lines(message: messages.Message) -> list[str]:
    block = message.headers.decode()
    assert block.startswith("NATS/1.0\r\n") and block.endswith("\r\n\r\n")
    return block[len("NATS/1.0\r\n") : -4].split("\r\n")


def parsed(message: messages.Message) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in header_lines(message))


def test_the_message_carries_the_job_id_name_and_the_rabbitmq_body() -> None:
    staged = job(ordering_key="customer-7", traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    message = messages.build(staged, subjects=messages.Subjects("jobs"), max_payload=MAX_PAYLOAD)
    assert message.subject == b"jobs.email"
    headers = parsed(message)
    assert headers["Nats-Msg-Id"] == f"{staged.job_id}:{staged.id}"
    assert headers["Drain-Job-Name"] == "app.tasks.send"
    assert headers[models.ORDERING_KEY_HEADER] == "customer-7"
    assert headers["traceparent"] == staged.traceparent
    assert json.loads(message.body) == {
        "job_id": str(staged.job_id),
        "job_name": "app.tasks.send",
        "args": [1, "two"],
        "kwargs": {"three": 3},
        "queue": "email",
        "created_at": "2026-01-02T03:04:05+00:00",
        "options": {},
    }


def test_a_tick_carries_its_schedule_and_tick_as_headers() -> None:
    staged = job(schedule="nightly", tick="2026-01-02T03:00:00+00:00")
    headers = parsed(messages.build(staged, subjects=messages.Subjects("jobs"), max_payload=MAX_PAYLOAD))
    assert headers[models.SCHEDULE_OPTION] == "nightly"
    assert headers[models.TICK_OPTION] == "2026-01-02T03:00:00+00:00"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"queue": "a b"}, "whitespace"),
        ({"queue": "a..b"}, "empty token"),
        ({"queue": "a.*"}, "wildcard"),
        ({"queue": "a.>"}, "wildcard"),
        ({"queue": ""}, "empty"),
        ({"queue": "q\r\nPUB x 1"}, "whitespace"),
        ({"job_name": "x\r\nNats-Rollup: all"}, "line break"),
        ({"ordering_key": "k\nNats-Expected-Stream: X"}, "line break"),
        ({"options": {"headers": {"Nats-Rollup": "all"}}}, "JetStream's own"),
        ({"options": {"headers": {"nats-expected-last-sequence": "1"}}}, "JetStream's own"),
        ({"options": {"headers": {"a:b": "x"}}}, "colon"),
        ({"options": {"headers": {"ok": {"nested": 1}}}}, "is text"),
        ({"options": {"headers": "not an object"}}, "must be an object"),
        ({"options": {"priority": 3}}, "unknown NATS option"),
        ({"args": [float("nan")]}, "not valid JSON"),
        ({"args": ["x" * (MAX_PAYLOAD + 1)]}, "max_payload"),
        ({"options": {"headers": {"x-big": "v" * 70_000}}}, "JetStream's limit"),
        ({"job_name": "n" * 65_536}, "JetStream's limit"),
    ],
)
def test_what_the_protocol_or_jetstream_would_refuse_is_the_rows_rejection(
    changes: dict[str, Any], reason: str
) -> None:
    with pytest.raises(errors.JobRefused, match=reason):
        messages.build(job(**changes), subjects=messages.Subjects("jobs"), max_payload=MAX_PAYLOAD)


def test_a_header_block_of_exactly_jetstreams_limit_is_built() -> None:
    plain = len(messages.build(job(), subjects=messages.Subjects("jobs"), max_payload=MAX_PAYLOAD).headers)
    name = "n" * (messages.MAX_HEADER_BYTES - plain + len("app.tasks.send"))
    message = messages.build(job(job_name=name), subjects=messages.Subjects("jobs"), max_payload=MAX_PAYLOAD)
    assert len(message.headers) == messages.MAX_HEADER_BYTES
    with pytest.raises(errors.JobRefused, match="JetStream's limit"):
        messages.build(job(job_name=name + "n"), subjects=messages.Subjects("jobs"), max_payload=MAX_PAYLOAD)


@settings(max_examples=300, deadline=None)
@given(
    queue=st.text(max_size=30),
    name=st.text(max_size=30),
    key=st.none() | st.text(min_size=1, max_size=30),
    headers=st.dictionaries(st.text(max_size=10), st.text(max_size=20) | st.integers(), max_size=4),
)
def test_no_value_a_row_holds_adds_a_header_line_or_a_protocol_field(
    queue: str, name: str, key: str | None, headers: dict[str, Any]
) -> None:
    staged = job(queue=queue, job_name=name, ordering_key=key, options={"headers": headers})
    try:
        message = messages.build(staged, subjects=messages.Subjects("jobs"), max_payload=MAX_PAYLOAD)
    except errors.JobRefused:
        return
    assert not any(char.isspace() for char in message.subject.decode())
    lines = header_lines(message)
    expected = 3 + len(headers) + (key is not None) - ("Drain-Job-Name" in headers)
    expected -= models.ORDERING_KEY_HEADER in headers and key is not None
    assert len(lines) == expected
    found = parsed(message)
    assert found["Nats-Msg-Id"] == f"{staged.job_id}:{staged.id}"
    assert found["Drain-Job-Name"] == name
    assert not any(line.lower().startswith("nats-") for line in lines[1:])


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(args=st.lists(JSON, max_size=3), kwargs=st.dictionaries(st.text(max_size=5), JSON, max_size=3))
def test_the_body_is_written_as_the_standard_encoder_writes_it(
    args: list[Any], kwargs: dict[str, Any]
) -> None:
    """The body's encoder is built once (messages.compact_encoder): byte for byte what
    json.JSONEncoder writes with the same settings."""
    staged = job(args=args, kwargs=kwargs, options={"headers": {"x": "1"}})
    expected = messages.ENCODER.encode(
        {
            "job_id": str(staged.job_id),
            "job_name": staged.job_name,
            "args": args,
            "kwargs": kwargs,
            "queue": staged.queue,
            "created_at": staged.created_at.isoformat(),
            "options": staged.options,
        }
    )
    assert messages.body(staged, str(staged.job_id)) == expected.encode()


def test_a_body_nested_too_deeply_or_holding_itself_is_the_rows_rejection() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    itself: list[Any] = []
    itself.append(itself)
    for args in (deep, itself, [float("inf")]):
        with pytest.raises(errors.JobRefused):
            messages.build(job(args=args), subjects=messages.Subjects("jobs"), max_payload=MAX_PAYLOAD)


def test_settings_keep_passwords_and_tokens_out_of_repr_and_errors() -> None:
    parsed_settings = nats_settings.NatsSettings.parse(
        "events", {"url": "nats://drain:s3cret-pw@10.0.0.1:4222,tls://10.0.0.2"}, 10.0
    )
    assert parsed_settings.user == "drain"
    assert [str(server) for server in parsed_settings.servers] == ["10.0.0.1:4222", "10.0.0.2:4222"]
    assert parsed_settings.servers[1].tls
    assert "s3cret-pw" not in repr(parsed_settings)
    assert "s3cret-pw" not in parsed_settings.describe("login failed for drain:s3cret-pw")
    with_token = nats_settings.NatsSettings.parse("events", {"token": "t0ken-value"}, 10.0)
    assert "t0ken-value" not in repr(with_token)
    assert "t0ken-value" not in with_token.describe(OSError("t0ken-value rejected"))


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"url": "nats://t0ken@host:4222"}, "token"),
        ({"url": "http://host"}, "nats://"),
        ({"subject_prefix": "jobs.>"}, "wildcard"),
        ({"queues": ["a b"]}, "whitespace"),
        ({"user": "u", "password": "p", "token": "t"}, "choose one"),
        ({"user": "u"}, "needs password"),
        ({"tls_cert_file": "/c.pem"}, "go together"),
        ({"publish_timeout_s": 99}, "at most"),
        ({"surprise": 1}, "unknown key"),
    ],
)
def test_bad_settings_are_named(values: dict[str, Any], problem: str) -> None:
    with pytest.raises(errors.ConfigError, match=problem) as raised:
        nats_settings.NatsSettings.parse("events", values, 10.0)
    assert "t0ken" not in str(raised.value)
