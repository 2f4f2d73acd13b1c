"""What a consumer sees of a schedule's tick, per backend: its name and tick travel in the row as
reserved options (drain.models.TICK_OPTIONS), leave the options when the row is read, and each
adapter passes them on where it can — RQ's ``job.meta``, the AMQP headers (and the body's
``options.headers``, as if the row's own) — exactly as when the core put them in those options
itself, in the key order jsonb kept them then (shorter keys first); Celery carries the job id
only. A row whose reserved keys no schedule could have staged is unreadable, never delivered
with them silently dropped."""

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

from drain import models, testing
from drain.config import settings as config
from drain.relay import schedules
from drain.store import reading

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
TICK = datetime.datetime(2026, 1, 1, 3, 0, tzinfo=datetime.UTC)
METADATA = {"drain_tick": "2026-01-01T03:00:00+00:00", "drain_schedule": "nightly"}  # jsonb's order


def tick_job(options: Mapping[str, Any]) -> models.StagedJob:
    """The job of one tick of a schedule with these options, as the store reads its row."""
    schedule = config.ScheduleSettings(
        name="nightly", cron="0 3 * * *", job_name="app.tasks.send", backend="default", options=dict(options)
    )
    rest, name, tick = reading.split_tick(schedules.tick_options(schedule, TICK))
    return models.StagedJob(
        7, uuid.uuid4(), "app.tasks.send", [1], {}, "q", "default", rest, NOW, schedule=name, tick=tick
    )


def rq_meta(job: models.StagedJob) -> Any:
    the_adapter = rq_adapter.RQAdapter.from_options(
        "default", {"url": "redis://127.0.0.1:1/0", "allowed_jobs": ["app.tasks.send"]}, publish_timeout_s=5
    )
    fields = the_adapter.build(job, b"now").fields
    return pickle.loads(fields[b"meta"]) if b"meta" in fields else None


def rabbitmq_build(job: models.StagedJob) -> Any:
    return rabbitmq_messages.build(job, max_body_bytes=1_000_000, frame_max=pika.spec.FRAME_MAX_SIZE)


def test_the_tick_leaves_the_options_when_read() -> None:
    job = tick_job({"meta": {"mine": 1}})
    assert (job.schedule, job.tick, dict(job.options)) == (
        "nightly",
        METADATA["drain_tick"],
        {"meta": {"mine": 1}},
    )
    assert reading.split_tick({"x": 1}) == ({"x": 1}, None, None)


@pytest.mark.parametrize(
    "reserved",
    [
        {"drain_schedule": 5, "drain_tick": "2026-01-01T03:00:00+00:00"},
        {"drain_schedule": "nightly", "drain_tick": {"nested": 1}},
        {"drain_schedule": "nightly"},
        {"drain_tick": "2026-01-01T03:00:00+00:00"},
        {"drain_schedule": "n" * 201, "drain_tick": "2026-01-01T03:00:00+00:00"},
        {"drain_schedule": "", "drain_tick": "2026-01-01T03:00:00+00:00"},
        {"drain_schedule": "a\nb", "drain_tick": "2026-01-01T03:00:00+00:00"},
        {"drain_schedule": "nightly", "drain_tick": "yesterday"},
        {"drain_schedule": "nightly", "drain_tick": "2026-01-01T03:00:00+00:00" + " " * 64},
    ],
)
def test_reserved_tick_keys_no_schedule_could_stage_make_the_row_unreadable(reserved: dict[str, Any]) -> None:
    with pytest.raises(reading.Unreadable, match="reserved for the ticks of"):
        reading.split_tick({"x": 1, **reserved})


@pytest.mark.parametrize(
    ("own", "seen"),
    [
        (None, METADATA),
        ({"mine": 1}, {"mine": 1, **METADATA}),
        ({"drain_tick": "mine", "x": 2}, {"x": 2, **METADATA}),
        ({"a_key_longer_than_14": 1}, {**METADATA, "a_key_longer_than_14": 1}),
    ],
)
def test_rq_puts_the_tick_in_the_job_meta(own: dict[str, Any] | None, seen: dict[str, Any]) -> None:
    job = tick_job({} if own is None else {"meta": own})
    assert rq_meta(job) == seen
    assert list(rq_meta(job)) == list(seen)


def test_an_rq_job_that_is_no_tick_has_no_tick_meta() -> None:
    job = dataclasses.replace(tick_job({"meta": {"mine": 1}}), schedule=None, tick=None)
    assert rq_meta(job) == {"mine": 1}


@pytest.mark.parametrize(
    ("own", "headers"),
    [
        (None, METADATA),
        ({"owner": 1}, {"owner": 1, **METADATA}),
        ({"drain_schedule": "mine"}, METADATA),
    ],
)
def test_rabbitmq_puts_the_tick_in_the_headers_and_the_body_options(
    own: dict[str, Any] | None, headers: dict[str, Any]
) -> None:
    options: dict[str, Any] = {"priority": 3} if own is None else {"priority": 3, "headers": own}
    message = rabbitmq_build(tick_job(options))
    assert list(message.properties.headers.items()) == list(headers.items())
    body_options = json.loads(message.body)["options"]
    assert list(body_options) == ["headers", "priority"]
    assert list(body_options["headers"].items()) == list(headers.items())


def test_a_rabbitmq_message_that_is_no_tick_is_as_it_was() -> None:
    message = rabbitmq_build(dataclasses.replace(tick_job({"priority": 3}), schedule=None, tick=None))
    assert message.properties.headers is None
    assert json.loads(message.body)["options"] == {"priority": 3}


def test_celery_carries_the_job_id_only() -> None:
    job = tick_job({})
    message = celery_message.build(celery_message.new_app(), job, reply_to="r", now=NOW)
    assert not set(METADATA) & set(message.headers)
    assert b"drain_schedule" not in message.body


def test_the_memory_adapter_shows_the_tick_in_the_job_meta() -> None:
    adapter = testing.MemoryAdapter()
    adapter.publish_batch([tick_job({"meta": {"owner": "ops"}})])
    assert list(adapter.published[0].options["meta"].items()) == [("owner", "ops"), *METADATA.items()]
