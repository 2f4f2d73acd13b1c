"""A worker cannot tell the drain's message from ``actor.send()``'s: Dramatiq's own brokers are
run up to their I/O (the script call on Redis, ``queue_declare`` and ``basic_publish`` on
RabbitMQ), and what they would write is compared byte for byte with what the drain writes for the
same job. Only what ``send()`` draws fresh is taken from its message: the id (the drain's is the
job id), the timestamp and, on Redis, the hash key (the drain's is the job id too)."""

from __future__ import annotations

import datetime
import json
import uuid
from typing import Any

import dramatiq
import hypothesis
import pika
from drain_adapters.dramatiq import message as dramatiq_message
from drain_adapters.dramatiq import rabbitmq_link, redis_publisher
from dramatiq.brokers import rabbitmq as dramatiq_rabbitmq
from dramatiq.brokers import redis as dramatiq_redis
from hypothesis import strategies as st

from drain import models

RESERVED = {
    *dramatiq_message.RESERVED_OPTIONS,
    *dramatiq_message.CALLBACK_OPTIONS,
    *dramatiq_message.MESSAGE_OPTIONS,
    *dramatiq_message.TRACE_OPTIONS,
    *models.TICK_OPTIONS,
    models.ORDERING_KEY_META,
    dramatiq_message.PRIORITY_OPTION,
}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
queues = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9._-]{0,40}", fullmatch=True).filter(
    lambda q: dramatiq_message.queue_problem(q) is None and dramatiq_message.redis_queue_problem(q) is None
)
options = st.dictionaries(st.text(max_size=12).filter(lambda k: k not in RESERVED), json_values, max_size=4)


class CapturedRedisBroker(dramatiq_redis.RedisBroker):
    """Dramatiq's Redis broker, stopped where its enqueue calls its script."""

    def __init__(self) -> None:
        super().__init__(url="redis://127.0.0.1:1/0")  # never connected
        self.enqueued: list[tuple[str, str, bytes]] = []

    def do_enqueue(self, queue_name: str, redis_message_id: str, data: bytes) -> None:
        self.enqueued.append((queue_name, redis_message_id, data))


class RecordingChannel:
    def __init__(self) -> None:
        self.declared: list[tuple[str, dict[str, Any]]] = []
        self.published: list[tuple[str, str, bytes, pika.BasicProperties]] = []

    def queue_declare(self, queue: str, durable: bool, arguments: dict[str, Any]) -> None:
        assert durable
        self.declared.append((queue, arguments))

    def basic_publish(
        self, exchange: str, routing_key: str, body: bytes, properties: Any, mandatory: bool
    ) -> None:
        self.published.append((exchange, routing_key, body, properties))


class CapturedRabbitmqBroker(dramatiq_rabbitmq.RabbitmqBroker):
    """Dramatiq's RabbitMQ broker, its channel recording instead of sending."""

    def __init__(self, max_priority: int | None = None) -> None:
        super().__init__(
            url="amqp://guest:guest@127.0.0.1:1/%2F", max_priority=max_priority, confirm_delivery=True
        )
        self.recorded = RecordingChannel()

    @property
    def channel(self) -> Any:
        return self.recorded


def sent_by_dramatiq(
    broker: dramatiq.Broker,
    actor_name: str,
    queue: str,
    args: list[Any],
    kwargs: dict[str, Any],
    options: dict[str, Any],
) -> dramatiq.Message[Any]:
    actor = dramatiq.Actor(
        lambda *a, **k: None, actor_name=actor_name, queue_name=queue, priority=0, broker=broker, options={}
    )
    return actor.send_with_options(args=tuple(args), kwargs=kwargs, **options)


def same_job(
    sent: dramatiq.Message[Any], args: list[Any], kwargs: dict[str, Any], options: dict[str, Any]
) -> models.StagedJob:
    return models.StagedJob(
        id=1,
        job_id=uuid.UUID(sent.message_id),
        job_name=sent.actor_name,
        args=args,
        kwargs=kwargs,
        queue=sent.queue_name,
        backend="default",
        options=options,
        created_at=datetime.datetime.now(datetime.UTC),
    )


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    actor_name=st.text(min_size=1, max_size=30),
    queue=queues,
    args=st.lists(json_values, max_size=4),
    kwargs=st.dictionaries(st.text(max_size=10), json_values, max_size=4),
    options=options,
)
def test_redis_message_is_what_send_writes(
    actor_name: str, queue: str, args: list[Any], kwargs: dict[str, Any], options: dict[str, Any]
) -> None:
    broker = CapturedRedisBroker()
    sent = sent_by_dramatiq(broker, actor_name, queue, args, kwargs, options)
    [(queue_name, redis_id, data)] = broker.enqueued
    job = same_job(sent, args, kwargs, options)
    ours = dramatiq_message.build(
        job,
        now_ms=sent.message_timestamp,
        allowed=None,
        max_bytes=2**29,
        redis=True,
    )
    assert ours.queue == queue_name and ours.message_id == f"{sent.message_id}:{job.id}"
    # send() keys the message by a fresh UUID; the drain by the job id and row (re-publishes found)
    assert ours.body == data.replace(redis_id.encode(), ours.message_id.encode())
    assert redis_publisher.keys("dramatiq", queue) == (f"dramatiq:{queue}", f"dramatiq:{queue}.msgs")


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    actor_name=st.text(min_size=1, max_size=30),
    queue=queues,
    args=st.lists(json_values, max_size=4),
    kwargs=st.dictionaries(st.text(max_size=10), json_values, max_size=4),
    options=options,
    priority=st.none() | st.integers(0, 255),
    max_priority=st.none() | st.integers(1, 255),
)
def test_rabbitmq_message_and_queues_are_what_send_writes(
    actor_name: str,
    queue: str,
    args: list[Any],
    kwargs: dict[str, Any],
    options: dict[str, Any],
    priority: int | None,
    max_priority: int | None,
) -> None:
    if priority is not None:
        options = {**options, "broker_priority": priority}
    broker = CapturedRabbitmqBroker(max_priority)
    sent = sent_by_dramatiq(broker, actor_name, queue, args, kwargs, options)
    [(exchange, routing_key, body, properties)] = broker.recorded.published
    job = same_job(sent, args, kwargs, options)
    ours = dramatiq_message.build(
        job,
        now_ms=sent.message_timestamp,
        allowed=None,
        max_bytes=2**27,
        redis=False,
    )
    wire = rabbitmq_link.wire(ours)
    assert (exchange, routing_key, body) == ("", wire.routing_key, wire.body)
    assert properties.encode() == wire.properties.encode()
    ttl = dramatiq_rabbitmq.DEAD_MESSAGE_TTL
    assert broker.recorded.declared == rabbitmq_link.declarations(queue, max_priority, ttl)


def test_the_trace_context_tick_and_key_travel_in_the_options() -> None:
    job = models.StagedJob(
        id=1,
        job_id=uuid.uuid4(),
        job_name="app.send",
        args=[],
        kwargs={},
        queue="default",
        backend="default",
        options={"max_retries": 3},
        created_at=datetime.datetime.now(datetime.UTC),
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        tracestate="a=b",
        schedule="nightly",
        tick="2026-01-01T03:00:00+00:00",
        ordering_key="account-7",
    )
    built = dramatiq_message.build(
        job, now_ms=1, allowed=frozenset({"app.send"}), max_bytes=10_000, redis=True
    )
    assert json.loads(built.body)["options"] == {
        "max_retries": 3,
        "traceparent": job.traceparent,
        "tracestate": "a=b",
        "drain_schedule": "nightly",
        "drain_tick": "2026-01-01T03:00:00+00:00",
        "ordering_key": "account-7",
        "redis_message_id": f"{job.job_id}:{job.id}",
    }
