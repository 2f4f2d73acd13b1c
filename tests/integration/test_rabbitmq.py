"""The RabbitMQ backend against the shared broker: end to end to a real consumer, and what a
message looks like. Queues are the test's own and deleted afterwards."""

from __future__ import annotations

import datetime
import json
import uuid

import psycopg
import pytest
from drain_adapters import rabbitmq

import drain
from drain import models, relay
from tests.support import ledger, rabbit

BACKEND = "events"


@pytest.fixture(autouse=True)
def _need_broker() -> None:
    rabbit.need_rabbitmq()


def test_committed_jobs_reach_a_real_consumer_and_rolled_back_never(database: str) -> None:
    names = tuple(rabbit.unique_name(f"e2e{n}") for n in range(3))
    with rabbit.queues(rabbit.SHARED_URL, *names):
        committed = rabbit.stage_jobs(database, 10_000, names, BACKEND)
        rolled_back = rabbit.stage_jobs(database, 1_000, names, BACKEND, commit=False, per_txn=250)
        settings = rabbit.drain_settings(database, BACKEND, {"url": rabbit.SHARED_URL})
        with (
            rabbit.Consumer(rabbit.SHARED_URL, names) as consumer,
            rabbit.running_relay(settings),
        ):
            ledger.wait_until(
                lambda: len(set(consumer.received)) >= len(committed) or consumer.error is not None,
                120,
                "the consumer to receive every committed job",
            )
        assert consumer.error is None
    received = set(consumer.received)
    assert received == committed
    assert not received & rolled_back
    assert consumer.mismatched == []
    assert rabbit.staged_count(database) == 0


def test_an_unroutable_job_is_rejected_and_never_blocks_the_batch(database: str) -> None:
    (queue,) = names = (rabbit.unique_name("route"),)
    with rabbit.queues(rabbit.SHARED_URL, *names), psycopg.connect(database) as conn:
        good = [drain.stage(conn, "app.tasks.a", args=[n], queue=queue, backend=BACKEND) for n in range(20)]
        bad = drain.stage(conn, "app.tasks.a", queue=rabbit.unique_name("nowhere"), backend=BACKEND)
        good += [drain.stage(conn, "app.tasks.a", args=[n], queue=queue, backend=BACKEND) for n in range(20)]
        conn.commit()
        settings = rabbit.drain_settings(database, BACKEND, {"url": rabbit.SHARED_URL})
        the_relay = relay.Relay(
            settings,
            {
                BACKEND: rabbitmq.RabbitMQAdapter.from_options(
                    BACKEND, {"url": rabbit.SHARED_URL}, publish_timeout_s=30
                )
            },
        )
        try:
            assert the_relay.leadership.try_acquire()
            report = the_relay.drain_once()
        finally:
            the_relay.shutdown()
        assert (report.selected, report.published, report.rejected) == (41, 40, 1)
        held = rabbit.take_all(rabbit.SHARED_URL, queue)
        assert set(held) == {str(job_id) for job_id in good}
        row = conn.execute(
            "SELECT attempts, last_error FROM staged_jobs WHERE job_id = %s", (bad,)
        ).fetchone()
    assert row is not None
    attempts, last_error = row
    assert attempts == 1
    assert "NO_ROUTE" in last_error
    assert rabbit.staged_count(database) == 1


def test_the_message_carries_the_contract(database: str) -> None:
    (queue,) = names = (rabbit.unique_name("shape"),)
    adapter = rabbitmq.RabbitMQAdapter.from_options(BACKEND, {"url": rabbit.SHARED_URL}, publish_timeout_s=30)
    with rabbit.queues(rabbit.SHARED_URL, *names), psycopg.connect(database) as conn:
        job_id = drain.stage(
            conn,
            "app.tasks.email",
            args=["a@example.com"],
            kwargs={"urgent": True},
            queue=queue,
            backend=BACKEND,
            options={"priority": 5, "expiration": 60000, "headers": {"tenant": "t1"}},
        )
        unknown = drain.stage(conn, "app.tasks.email", queue=queue, backend=BACKEND, options={"ttl": 5})
        conn.commit()
        settings = rabbit.drain_settings(database, BACKEND, {"url": rabbit.SHARED_URL})
        the_relay = relay.Relay(settings, {BACKEND: adapter})
        try:
            assert the_relay.leadership.try_acquire()
            report = the_relay.drain_once()
        finally:
            the_relay.shutdown()
        assert (report.published, report.rejected) == (1, 1)
        held = rabbit.take_all(rabbit.SHARED_URL, queue)
        (last_error,) = conn.execute(
            "SELECT last_error FROM staged_jobs WHERE job_id = %s", (unknown,)
        ).fetchone() or ("",)
    assert "unknown RabbitMQ option(s) ttl" in last_error
    properties, body = held[str(job_id)]
    assert properties.message_id == str(job_id)
    assert properties.type == "app.tasks.email"
    assert properties.content_type == "application/json"
    assert properties.delivery_mode == 2
    assert (properties.priority, properties.expiration) == (5, "60000")
    assert properties.headers == {"tenant": "t1"}
    assert set(body) == {"job_id", "job_name", "args", "kwargs", "queue", "created_at", "options"}
    assert body["job_id"] == str(job_id)
    assert (body["args"], body["kwargs"], body["queue"]) == (["a@example.com"], {"urgent": True}, queue)


def test_declare_creates_the_exchange_and_queues(database: str) -> None:
    exchange, queue = rabbit.unique_name("exchange"), rabbit.unique_name("declared")
    adapter = rabbitmq.RabbitMQAdapter.from_options(
        BACKEND,
        {"url": rabbit.SHARED_URL, "exchange": exchange, "declare": True, "queues": [queue]},
        publish_timeout_s=30,
    )
    try:
        adapter.open()
        now = datetime.datetime.now(datetime.UTC)
        job = models.StagedJob(1, uuid.uuid4(), "app.tasks.x", [], {}, queue, BACKEND, {}, now)
        assert adapter.publish_batch([job])[0].outcome is models.Outcome.PUBLISHED
        assert set(rabbit.take_all(rabbit.SHARED_URL, queue)) == {str(job.job_id)}
    finally:
        adapter.close()
        rabbit.delete_queues(rabbit.SHARED_URL, queue)
        rabbit.delete_exchange(rabbit.SHARED_URL, exchange)


def test_a_missing_exchange_makes_the_backend_unavailable_not_each_job_retry() -> None:
    exchange, queue = rabbit.unique_name("exchange"), rabbit.unique_name("bound")
    missing = rabbitmq.RabbitMQAdapter.from_options(
        BACKEND, {"url": rabbit.SHARED_URL, "exchange": rabbit.unique_name("nowhere")}, publish_timeout_s=5
    )
    with pytest.raises(drain.BackendUnavailable, match=r"is missing or unusable.*NOT_FOUND"):
        missing.open()
    missing.close()

    adapter = rabbitmq.RabbitMQAdapter.from_options(
        BACKEND,
        {"url": rabbit.SHARED_URL, "exchange": exchange, "declare": True, "queues": [queue]},
        publish_timeout_s=5,
    )
    now = datetime.datetime.now(datetime.UTC)
    jobs = [models.StagedJob(n, uuid.uuid4(), "app.x", [], {}, queue, BACKEND, {}, now) for n in range(3)]
    try:
        adapter.open()
        assert adapter.publish_batch(jobs[:1])[0].outcome is models.Outcome.PUBLISHED
        rabbit.delete_exchange(rabbit.SHARED_URL, exchange)  # deleted behind the drain's back
        with pytest.raises(drain.BackendUnavailable, match="NOT_FOUND"):
            adapter.publish_batch(jobs[1:])
    finally:
        adapter.close()
        rabbit.delete_queues(rabbit.SHARED_URL, queue)
        rabbit.delete_exchange(rabbit.SHARED_URL, exchange)


def test_settings_report_every_problem_and_hide_the_password() -> None:
    with pytest.raises(drain.ConfigError) as caught:
        rabbitmq.RabbitMQAdapter.from_options(
            BACKEND,
            {"url": "http://x", "exchange_type": "weird", "queues": ["q"], "colour": 1},
            publish_timeout_s=10,
        )
    problems = "\n".join(caught.value.problems)
    for key in ("url", "exchange_type", "queues", "colour"):
        assert f"backends.{BACKEND}.{key}" in problems
    with pytest.raises(drain.ConfigError) as too_long:
        rabbitmq.RabbitMQSettings.parse(
            BACKEND, {"exchange": "é" * 128, "declare": True, "queues": ["q" * 256]}, 10
        )
    assert {problem.split(":")[0] for problem in too_long.value.problems} == {
        f"backends.{BACKEND}.exchange",
        f"backends.{BACKEND}.queues",
    }
    settings = rabbitmq.RabbitMQSettings.parse(
        BACKEND, {"url": "amqp://app:s3cret@127.0.0.1:1/%2F", "exchange": ""}, 10
    )
    assert "s3cret" not in repr(settings)
    adapter = rabbitmq.RabbitMQAdapter(BACKEND, settings)
    with pytest.raises(drain.BackendUnavailable) as down:
        adapter.open()
    assert "s3cret" not in str(down.value)
    assert json.dumps(settings.exchange) == '""'
