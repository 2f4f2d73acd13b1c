"""A slow link never stretches a backend call past its deadline (issue 35).

Every reply of the broker comes 0.8 × ``publish_timeout_s`` late: a delaying proxy in front of
Redis (RQ) or RabbitMQ (Celery on AMQP, py-amqp; the RabbitMQ backend, pika). Each socket wait
alone stays within its timeout, so a call of many round trips used to add them up: with
``publish_timeout_s = 5`` an RQ batch (connect, handshake, ping, the pipe's own connection, the
script) took 32 s and Celery's AMQP handshake 21 s, against the 15 s idle-in-transaction fence
that ends the leader's session. (Here, with 2 s: RQ's step outlived the 12 s fence and the
session was ended, Celery's took 9 s; pika's connect was bounded already.)

Now one deadline covers the whole call (``open`` and the batch after it, every handshake reply,
the confirms): the step fails as an outage within ``publish_timeout_s`` and a margin for its own
database work, far below the fence. No row is touched or dead-lettered, and once the link is
fast again every committed row reaches the broker.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
import redis
import rq

import drain
from drain import backend, config
from drain.relay import loop as relay
from drain.store import connection
from tests.support import proxy, rabbit
from tests.support.waiting import wait_until

PUBLISH_TIMEOUT_S = 2.0
REPLY_DELAY_S = 0.8 * PUBLISH_TIMEOUT_S
MARGIN_S = 1.0  # the step's select and rollback, a last look at what arrived: not a speed target
ROWS = 20
HEAL_TIMEOUT_S = 60.0
JOB = "app.tasks.ok"


@dataclasses.dataclass
class Broker:
    """A backend section reached through the slow link, and what it delivered once healed."""

    options: dict[str, object]
    delivered: Callable[[str], set[str]]


def stage(database: str, queue: str) -> list[uuid.UUID]:
    with psycopg.connect(database) as conn:
        return drain.stage_many(conn, [drain.Job(JOB, args=[n], queue=queue) for n in range(ROWS)])


def counts(database: str) -> tuple[int, int, int]:
    """(rows staged, rows with an attempt counted, rows dead-lettered)."""
    with psycopg.connect(database, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM staged_jobs), "
            "(SELECT count(*) FROM staged_jobs WHERE attempts > 0), "
            "(SELECT count(*) FROM staged_jobs_dead)"
        ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


@pytest.fixture
def rq_broker(redis_db: str) -> Iterator[tuple[Broker, proxy.DelayProxy]]:
    slow = proxy.DelayProxy("127.0.0.1", 6379, REPLY_DELAY_S)
    db_index = redis_db.rsplit("/", 1)[1]

    def delivered(queue: str) -> set[str]:
        client = redis.Redis.from_url(redis_db)
        try:
            return set(rq.Queue(queue, connection=client).job_ids)
        finally:
            client.close()

    url = f"redis://127.0.0.1:{slow.port}/{db_index}"
    try:
        yield Broker({"type": "rq", "url": url, "allowed_jobs": [JOB]}, delivered), slow
    finally:
        slow.close()


@pytest.fixture
def celery_broker() -> Iterator[tuple[Broker, proxy.DelayProxy]]:
    rabbit.need_rabbitmq()
    slow = proxy.DelayProxy("127.0.0.1", 5672, REPLY_DELAY_S)
    taken: list[str] = []

    def delivered(queue: str) -> set[str]:
        taken.append(queue)
        return set(rabbit.take_counts(rabbit.SHARED_URL, (queue,), by="correlation_id"))

    url = f"amqp://guest:guest@127.0.0.1:{slow.port}//"
    try:
        yield Broker({"type": "celery", "broker_url": url, "allowed_jobs": [JOB]}, delivered), slow
    finally:
        slow.close()
        for queue in taken:
            rabbit.delete_queues(rabbit.SHARED_URL, queue)
            rabbit.delete_exchange(rabbit.SHARED_URL, queue)


@pytest.fixture
def rabbitmq_broker() -> Iterator[tuple[Broker, proxy.DelayProxy]]:
    rabbit.need_rabbitmq()
    slow = proxy.DelayProxy("127.0.0.1", 5672, REPLY_DELAY_S)
    taken: list[str] = []

    def delivered(queue: str) -> set[str]:
        taken.append(queue)
        return set(rabbit.take_counts(rabbit.SHARED_URL, (queue,)))

    url = f"amqp://guest:guest@127.0.0.1:{slow.port}/%2F"
    try:
        yield Broker({"type": "rabbitmq", "url": url, "declare": True}, delivered), slow
    finally:
        slow.close()
        for queue in taken:
            rabbit.delete_queues(rabbit.SHARED_URL, queue)


@pytest.mark.parametrize("broker", ["rq_broker", "celery_broker", "rabbitmq_broker"])
def test_a_slow_link_fails_the_call_within_its_deadline_and_loses_no_row(
    broker: str, request: pytest.FixtureRequest, settings: config.Settings, database: str
) -> None:
    the_broker, slow = request.getfixturevalue(broker)
    queue = f"drain-slow-{uuid.uuid4().hex[:8]}"
    options = dict(the_broker.options)
    kind = str(options.pop("type"))
    if kind == "rabbitmq":
        options["queues"] = [queue]  # declared by the drain when it opens
    settings = dataclasses.replace(
        settings,
        publish_timeout_s=PUBLISH_TIMEOUT_S,
        backends={"default": config.BackendSettings("default", kind, 3, options)},
    )
    fence_s = connection.idle_in_transaction_timeout_ms(PUBLISH_TIMEOUT_S) / 1000
    staged = stage(database, queue)
    the_relay = relay.Relay(settings, backend.build_adapters(settings.backends, PUBLISH_TIMEOUT_S))
    try:
        assert the_relay.leadership.try_acquire()
        started = time.monotonic()
        report = the_relay.drain_once()
        elapsed_s = time.monotonic() - started
        print(f"{kind}: a step over a slow link took {elapsed_s:.2f}s (fence {fence_s:.0f}s)")
        assert slow.connections, "the step never reached the broker through the slow link"
        assert not report.published
        assert elapsed_s < PUBLISH_TIMEOUT_S + MARGIN_S < fence_s
        assert counts(database) == (ROWS, 0, 0)  # untouched: waiting, no attempt, none dead

        slow.reply_delay_s = 0.0

        def healed() -> bool:
            the_relay.drain_once()
            return counts(database)[0] == 0

        wait_until("the rows to go once the link is fast", healed, HEAL_TIMEOUT_S)
    finally:
        the_relay.shutdown()
    assert counts(database) == (0, 0, 0)
    assert the_broker.delivered(queue) == {str(job_id) for job_id in staged}
