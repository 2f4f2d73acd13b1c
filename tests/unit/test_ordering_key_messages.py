"""What a consumer sees of a job's ordering key, per backend, and that a job without one is the
message it was before keys existed: RQ's ``job.meta["ordering_key"]``, the AMQP header
``x-ordering-key`` (RabbitMQ and Celery), and with the RabbitMQ backend's ``routing_key =
"ordering_key"`` the routing key. The key the drain kept the order of wins over a meta key or a
header of that name the row sets itself; it is never left out for the frame's sake."""

from __future__ import annotations

import dataclasses
import datetime
import json
import pickle
import uuid
from collections.abc import Mapping
from typing import Any

import pika.spec
import pytest
from drain_adapters import rq as rq_adapter
from drain_adapters.celery import message as celery_message
from drain_adapters.rabbitmq import messages as rabbitmq_messages
from drain_adapters.rabbitmq import settings as rabbitmq_settings

from drain import errors, models

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
KEY = "order-42"
HEADER = models.ORDERING_KEY_HEADER


def job(
    options: Mapping[str, Any] | None = None, *, key: str | None = KEY, **fields: Any
) -> models.StagedJob:
    return models.StagedJob(
        7,
        uuid.UUID(int=7),
        "app.tasks.send",
        [1, "x"],
        {"k": 2},
        "emails",
        "default",
        dict(options or {}),
        NOW,
        ordering_key=key,
        **fields,
    )


def rq_fields(staged: models.StagedJob) -> dict[bytes, bytes]:
    the_adapter = rq_adapter.RQAdapter.from_options(
        "default", {"url": "redis://127.0.0.1:1/0", "allowed_jobs": ["app.tasks.send"]}, publish_timeout_s=5
    )
    return the_adapter.build(staged, b"now").fields


def rq_meta(staged: models.StagedJob) -> Any:
    fields = rq_fields(staged)
    return pickle.loads(fields[b"meta"]) if b"meta" in fields else None


def rabbitmq_build(staged: models.StagedJob, **keys: Any) -> rabbitmq_messages.Message:
    keys.setdefault("frame_max", pika.spec.FRAME_MAX_SIZE)
    return rabbitmq_messages.build(staged, max_body_bytes=1_000_000, **keys)


def celery_build(staged: models.StagedJob) -> celery_message.CeleryMessage:
    return celery_message.build(celery_message.new_app(), staged, reply_to="r", now=NOW)


# --- RQ ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("own", "seen"),
    [
        (None, {"ordering_key": KEY}),
        ({"mine": 1}, {"mine": 1, "ordering_key": KEY}),
        ({"ordering_key": "forged", "x": 2}, {"ordering_key": KEY, "x": 2}),
    ],
)
def test_rq_puts_the_key_in_the_job_meta(own: dict[str, Any] | None, seen: dict[str, Any]) -> None:
    assert rq_meta(job(None if own is None else {"meta": own})) == seen


def test_rq_keeps_the_trace_context_beside_the_key() -> None:
    meta = rq_meta(job({"meta": {"mine": 1}}, traceparent=TRACEPARENT))
    assert list(meta.items()) == [("traceparent", TRACEPARENT), ("mine", 1), ("ordering_key", KEY)]


def test_an_rq_job_without_a_key_differs_from_a_keyed_one_by_its_meta_only() -> None:
    keyed, plain = rq_fields(job({"meta": {"mine": 1}})), rq_fields(job({"meta": {"mine": 1}}, key=None))
    assert pickle.loads(plain[b"meta"]) == {"mine": 1}
    assert {k: v for k, v in keyed.items() if k != b"meta"} == {
        k: v for k, v in plain.items() if k != b"meta"
    }
    assert b"meta" not in rq_fields(job(key=None))


# --- RabbitMQ ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("own", "headers"),
    [
        (None, {HEADER: KEY}),
        ({"owner": 1}, {"owner": 1, HEADER: KEY}),
        ({HEADER: "forged"}, {HEADER: KEY}),
    ],
)
def test_rabbitmq_puts_the_key_in_a_header_and_not_in_the_body(
    own: dict[str, Any] | None, headers: dict[str, Any]
) -> None:
    message = rabbitmq_build(job(None if own is None else {"headers": own}))
    assert message.properties.headers == headers
    assert message.routing_key == "emails"
    plain = rabbitmq_build(job(None if own is None else {"headers": own}, key=None))
    assert message.body == plain.body


def test_a_rabbitmq_message_without_a_key_is_as_it_was() -> None:
    plain = rabbitmq_build(job({"priority": 3}, key=None), exchange="events", by_key=True)
    assert plain.properties.headers is None
    assert plain.routing_key == "emails"
    assert json.loads(plain.body)["options"] == {"priority": 3}


def test_rabbitmq_routes_a_keyed_job_by_its_key_when_asked() -> None:
    message = rabbitmq_build(job({"headers": {"owner": 1}}), exchange="events", by_key=True)
    assert message.routing_key == KEY
    assert json.loads(message.body)["queue"] == "emails"
    assert message.properties.headers == {"owner": 1, HEADER: KEY}


def test_the_trace_context_gives_way_to_fit_one_frame_and_the_key_never_does() -> None:
    big = {"pad": "x" * 3_930}  # fits one 4 KiB frame with the key, not with the trace too
    message = rabbitmq_build(job({"headers": big}, traceparent=TRACEPARENT), frame_max=4_096)
    assert message.properties.headers == {**big, HEADER: KEY}
    with_room = rabbitmq_build(job({"headers": big}, traceparent=TRACEPARENT))
    assert list(with_room.properties.headers) == ["traceparent", "pad", HEADER]


def test_a_key_that_cannot_be_a_routing_key_is_refused_only_when_it_is_one() -> None:
    long_key = job(key="é" * 128)  # 256 bytes: the table refuses it; the message checks anyway
    assert rabbitmq_build(long_key).properties.headers == {HEADER: "é" * 128}
    with pytest.raises(errors.JobRefused, match="ordering_key \\(the routing key\\) is 256 bytes"):
        rabbitmq_build(long_key, exchange="events", by_key=True)


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"routing_key": "job_id"}, "routing_key: must be one of queue, ordering_key, not 'job_id'"),
        ({"routing_key": "ordering_key"}, 'routing_key: "ordering_key" needs a named exchange'),
        (
            {"routing_key": "ordering_key", "exchange": "jobs", "declare": True, "queues": ["q"]},
            'routing_key: "ordering_key" cannot be used with declare = true',
        ),
    ],
)
def test_the_routing_key_setting_is_checked_in_one_line(values: dict[str, Any], says: str) -> None:
    with pytest.raises(errors.ConfigError) as caught:
        rabbitmq_settings.RabbitMQSettings.parse("events", values, 10)
    (problem,) = caught.value.problems
    assert problem.startswith(f"backends.events.{says}")
    assert "\n" not in str(caught.value)


def test_the_routing_key_setting_defaults_to_the_queue() -> None:
    parse = rabbitmq_settings.RabbitMQSettings.parse
    assert not parse("events", {}, 10).by_key
    assert parse("events", {"routing_key": "ordering_key", "exchange": "jobs"}, 10).by_key


# --- Celery --------------------------------------------------------------------------------------


def test_celery_puts_the_key_in_the_message_headers() -> None:
    message = celery_build(job({"headers": {"owner": 1, HEADER: "forged"}}))
    assert message.headers["owner"] == 1
    assert message.headers[HEADER] == KEY
    assert message.routing_key == "emails"


def test_a_celery_message_without_a_key_differs_from_a_keyed_one_by_that_header_only() -> None:
    keyed, plain = (
        celery_build(job({"headers": {"owner": 1}})),
        celery_build(job({"headers": {"owner": 1}}, key=None)),
    )
    assert HEADER not in plain.headers
    assert {k: v for k, v in keyed.headers.items() if k != HEADER} == plain.headers
    assert dataclasses.replace(keyed, job=plain.job, headers=plain.headers) == plain
