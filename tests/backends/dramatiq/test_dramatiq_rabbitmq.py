"""Dramatiq on RabbitMQ: the queues Dramatiq's broker declares, declared by the drain before its
first publish (so jobs staged before any worker started wait in them); a queue a worker declared
with other arguments used as it is, never redeclared; a batch that runs out of time to declare
its new queues sends their jobs later (RETRY, uncounted)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pika
import pytest
from drain_adapters import dramatiq
from drain_adapters.dramatiq import rabbitmq_link

from drain import models
from tests.support import jobs, rabbit

ACTOR = "app.record"


@pytest.fixture
def queue() -> Iterator[str]:
    rabbit.need_rabbitmq()
    name = rabbit.unique_name("dramatiq").replace("-", "_")
    try:
        yield name
    finally:
        rabbit.delete_queues(rabbit.SHARED_URL, name, f"{name}.DQ", f"{name}.XQ")


def adapter(**options: object) -> dramatiq.DramatiqAdapter:
    values = {"url": rabbit.SHARED_URL, "allowed_actors": [ACTOR], **options}
    built = dramatiq.DramatiqAdapter.from_options("d", values, publish_timeout_s=10)
    built.open()
    return built


def counts(*queues: str) -> list[int]:
    connection = pika.BlockingConnection(pika.URLParameters(rabbit.SHARED_URL))
    try:
        channel = connection.channel()
        return [channel.queue_declare(name, passive=True).method.message_count for name in queues]
    finally:
        connection.close()


def test_jobs_staged_before_any_worker_wait_in_the_queues_dramatiq_declares(queue: str) -> None:
    backend = adapter()
    try:
        results = backend.publish_batch([jobs.staged(i, queue, ACTOR) for i in range(1, 6)])
        assert {r.outcome for r in results} == {models.Outcome.PUBLISHED}
        assert counts(queue, f"{queue}.DQ", f"{queue}.XQ") == [5, 0, 0]
    finally:
        backend.close()


def test_a_queue_declared_with_other_arguments_is_used_as_it_is(queue: str) -> None:
    """A worker's broker with ``max_priority=10`` declared it; the drain's section says nothing:
    RabbitMQ answers PRECONDITION_FAILED, the queue is neither redeclared nor an outage."""
    arguments = {
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": f"{queue}.XQ",
        "x-max-priority": 10,
    }
    with rabbit.queues(rabbit.SHARED_URL, queue, arguments=arguments):
        backend = adapter()
        try:
            batch = [jobs.staged(i, queue, ACTOR) for i in range(1, 4)]
            assert {r.outcome for r in backend.publish_batch(batch)} == {models.Outcome.PUBLISHED}
            assert {r.outcome for r in backend.publish_batch(batch)} == {models.Outcome.PUBLISHED}
            assert counts(queue)[0] == 6
        finally:
            backend.close()
        rabbit.delete_queues(rabbit.SHARED_URL, f"{queue}.DQ", f"{queue}.XQ")


def test_queues_not_declared_in_time_send_their_jobs_later(queue: str) -> None:
    backend = adapter()
    link = backend._amqp
    assert link is not None
    try:
        assert link.declare([queue], deadline=time.monotonic() - 1) == {queue: rabbitmq_link.LATE_DECLARATION}
        assert link.declare([queue], deadline=time.monotonic() + 10) == {queue: None}
        assert counts(queue) == [0]
    finally:
        backend.close()


def test_a_queue_the_broker_refuses_to_declare_makes_only_its_jobs_wait(queue: str) -> None:
    """Another connection holds a queue of that name exclusively (RESOURCE_LOCKED): a refusal of
    that queue, not of the backend; its jobs RETRY uncounted, the other queue's are published."""
    other = f"{queue}_free"
    holder = pika.BlockingConnection(pika.URLParameters(rabbit.SHARED_URL))
    try:
        holder.channel().queue_declare(queue, exclusive=True)
        backend = adapter()
        try:
            batch = [jobs.staged(i, queue if i % 2 else other, ACTOR) for i in range(1, 7)]
            results = {r.row_id: r for r in backend.publish_batch(batch)}
            for job in batch:
                expected = models.Outcome.RETRY if job.queue == queue else models.Outcome.PUBLISHED
                assert results[job.id].outcome is expected, results[job.id]
            assert "RESOURCE_LOCKED" in (results[1].error or ""), results[1]
            assert counts(other) == [3]
        finally:
            backend.close()
    finally:
        holder.close()
        rabbit.delete_queues(rabbit.SHARED_URL, other, f"{other}.DQ", f"{other}.XQ")
