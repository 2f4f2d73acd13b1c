"""The RabbitMQ backend against the shared broker: end to end to a real consumer, and what a
message looks like. Queues are the test's own and deleted afterwards."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import uuid

import pika
import psycopg
import pytest
from drain_adapters import rabbitmq

import drain
from drain import config, models
from drain.relay import loop as relay
from tests.support import faultload, ledger, rabbit
from tests.support.waiting import wait_until

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
            wait_until(
                "the consumer to receive every committed job",
                lambda: len(set(consumer.received)) >= len(committed) or consumer.error is not None,
                120,
            )
        assert consumer.error is None
    received = set(consumer.received)
    assert received == committed
    assert not received & rolled_back
    assert consumer.mismatched == []
    assert rabbit.staged_count(database) == 0


def test_an_unroutable_job_waits_uncounted_and_never_blocks_the_batch(database: str) -> None:
    """No route is the queue's fault, never the job's (issue 33: each was dead-lettered)."""
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
        assert (report.selected, report.published, report.rejected, report.retried) == (41, 40, 0, 1)
        held = rabbit.take_all(rabbit.SHARED_URL, queue)
        assert set(held) == {str(job_id) for job_id in good}
        row = conn.execute(
            "SELECT attempts, last_error FROM staged_jobs WHERE job_id = %s", (bad,)
        ).fetchone()
    assert row is not None
    attempts, last_error = row
    assert attempts == 0
    assert "NO_ROUTE" in last_error
    assert rabbit.staged_count(database) == 1


def test_a_declared_queue_deleted_mid_run_is_declared_again_and_a_typo_waits(
    database: str,
) -> None:
    """With ``declare = true``, a NO_ROUTE for one of ``queues`` means the queue was deleted
    behind the drain's back: its rows retry uncounted and the drain declares it again. A routing
    key that is not one of ``queues`` waits too, uncounted: no route is never the row's fault."""
    (queue,) = names = (rabbit.unique_name("redeclared"),)
    options = {"url": rabbit.SHARED_URL, "declare": True, "queues": [queue]}
    settings = rabbit.drain_settings(database, BACKEND, options)
    settings = dataclasses.replace(
        settings, backends={BACKEND: config.BackendSettings(BACKEND, "rabbitmq", 2, options)}
    )
    with rabbit.running_relay(settings):
        first = rabbit.stage_jobs(database, 20, names, BACKEND)
        wait_until("the first jobs", lambda: rabbit.staged_count(database) == 0, 60)
        held = rabbit.take_counts(rabbit.SHARED_URL, names)
        rabbit.delete_queues(rabbit.SHARED_URL, queue)  # the drain's connection stays up
        second = rabbit.stage_jobs(database, 50, names, BACKEND)
        typo = rabbit.stage_jobs(database, 1, (rabbit.unique_name("typo"),), BACKEND)
        wait_until("the rows to be settled", lambda: rabbit.staged_count(database) == 1, 60)
    with rabbit.queues(rabbit.SHARED_URL, *names):  # declared (if the drain did not), then deleted
        held += rabbit.take_counts(rabbit.SHARED_URL, names)
    with psycopg.connect(database) as conn:
        dead = {row[0] for row in conn.execute("SELECT job_id FROM staged_jobs_dead")}
        waiting = conn.execute("SELECT job_id, attempts FROM staged_jobs").fetchall()
    assert waiting == [(uuid.UUID(i), 0) for i in typo]
    counted = ledger.Tally(
        {uuid.UUID(i) for i in first | second},
        collections.Counter({uuid.UUID(i): n for i, n in held.items()}),
        dead,
    )
    print(counted)
    assert dead == set(), f"dead-lettered: {len(dead)} of {counted}"
    counted.check()


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
            {"url": "http://x", "exchange_type": "weird", "queues": ["amq.q"], "colour": 1},
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


def test_declaring_what_the_broker_refuses_is_a_config_error() -> None:
    """RabbitMQ refuses to declare an ``amq.`` queue (403; an empty name is refused as any empty
    string is) and an ``amq.`` exchange it does not predeclare: the drain would never open. Text
    with no UTF-8 form (an environment variable's undecodable bytes) is a problem of its key."""
    with pytest.raises(drain.ConfigError) as caught:
        rabbitmq.RabbitMQSettings.parse(
            BACKEND, {"declare": True, "queues": ["ok", "amq.q"], "exchange": "amq.mine"}, 10
        )
    problems = "\n".join(caught.value.problems)
    assert f"backends.{BACKEND}.queues: queue name 'amq.q' is reserved" in problems
    assert f"backends.{BACKEND}.exchange: amq. exchanges are the broker's own" in problems
    with pytest.raises(drain.ConfigError, match=r"amq\.topic \(topic\)"):
        rabbitmq.RabbitMQSettings.parse(BACKEND, {"declare": True, "exchange": "amq.topic"}, 10)
    with pytest.raises(drain.ConfigError) as unencodable:
        rabbitmq.RabbitMQSettings.parse(
            BACKEND, {"declare": True, "queues": ["q\udc80"], "exchange": "x\udc80"}, 10
        )
    assert len(unencodable.value.problems) == 2
    assert all("not valid Unicode" in problem for problem in unencodable.value.problems)
    settings = rabbitmq.RabbitMQSettings.parse(
        BACKEND, {"declare": True, "queues": ["q"], "exchange": "amq.topic", "exchange_type": "topic"}, 10
    )
    assert settings.exchange == "amq.topic"
    assert rabbitmq.RabbitMQSettings.parse(BACKEND, {"exchange": "amq.mine"}, 10).exchange == "amq.mine"
    with pytest.raises(drain.ConfigError) as line_breaks:  # the broker strips CR/LF: another name
        rabbitmq.RabbitMQSettings.parse(BACKEND, {"declare": True, "queues": ["q\n"], "exchange": "x\r"}, 10)
    assert len(line_breaks.value.problems) == 2
    assert all("contains a line break" in problem for problem in line_breaks.value.problems)


def test_url_takes_a_list_of_nodes_and_queue_type_needs_declare() -> None:
    first, second = "amqp://app:s3cret@10.0.0.1:5672/%2F", "amqp://app:s3cret@10.0.0.2:5672/%2F"
    listed = rabbitmq.RabbitMQSettings.parse(BACKEND, {"url": [first, second]}, 10)
    spelled = rabbitmq.RabbitMQSettings.parse(BACKEND, {"url": f"{first};{second}"}, 10)
    assert listed.urls == spelled.urls == (first, second)
    assert rabbitmq.RabbitMQSettings.parse(BACKEND, {"url": first}, 10).urls == (first,)
    assert "s3cret" not in repr(listed) and "10.0.0.2" in repr(listed)
    assert "s3cret" not in listed.describe(f"failed: {second} s3cret")
    with pytest.raises(drain.ConfigError) as caught:
        rabbitmq.RabbitMQSettings.parse(BACKEND, {"url": [first, "http://x"], "queue_type": "quorum"}, 10)
    assert {problem.split(":")[0] for problem in caught.value.problems} == {
        f"backends.{BACKEND}.url",
        f"backends.{BACKEND}.queue_type",  # only used with declare = true
    }
    with pytest.raises(drain.ConfigError, match="queue_type: must be one of classic, quorum"):
        rabbitmq.RabbitMQSettings.parse(BACKEND, {"declare": True, "queues": ["q"], "queue_type": "x"}, 10)
    with pytest.raises(drain.ConfigError, match="url: must be a non-empty string or a non-empty list"):
        rabbitmq.RabbitMQSettings.parse(BACKEND, {"url": []}, 10)


def test_a_dead_node_in_the_list_is_skipped_and_every_node_down_names_each() -> None:
    """The first node refuses connections: the adapter goes on to the next one within the same
    connect timeout (a refusal costs a round trip, not the timeout)."""
    port = faultload.free_port()
    dead = f"amqp://guest:s3cret@127.0.0.1:{port}/%2F"
    (queue,) = names = (rabbit.unique_name("nodes"),)
    now = datetime.datetime.now(datetime.UTC)
    job = models.StagedJob(1, uuid.uuid4(), "app.x", [], {}, queue, BACKEND, {}, now)
    adapter = rabbitmq.RabbitMQAdapter.from_options(
        BACKEND, {"url": [dead, rabbit.SHARED_URL], "connect_timeout_s": 30}, publish_timeout_s=30
    )
    with rabbit.queues(rabbit.SHARED_URL, *names):
        try:
            adapter.open()
            assert adapter.publish_batch([job])[0].outcome is models.Outcome.PUBLISHED
        finally:
            adapter.close()
        assert set(rabbit.take_all(rabbit.SHARED_URL, queue)) == {str(job.job_id)}
    down = rabbitmq.RabbitMQAdapter.from_options(
        BACKEND, {"url": [dead, dead.replace("s3cret", "other")]}, publish_timeout_s=5
    )
    with pytest.raises(drain.BackendUnavailable) as caught:
        down.open()
    assert str(caught.value).count(f"127.0.0.1:{port}:") == 2
    assert "s3cret" not in str(caught.value) and "other" not in str(caught.value)


def test_declare_makes_quorum_queues_when_asked() -> None:
    queue = rabbit.unique_name("quorum")
    adapter = rabbitmq.RabbitMQAdapter.from_options(
        BACKEND,
        {"url": rabbit.SHARED_URL, "declare": True, "queues": [queue], "queue_type": "quorum"},
        publish_timeout_s=30,
    )
    now = datetime.datetime.now(datetime.UTC)
    job = models.StagedJob(1, uuid.uuid4(), "app.x", [], {}, queue, BACKEND, {}, now)
    connection = pika.BlockingConnection(pika.URLParameters(rabbit.SHARED_URL))
    try:
        adapter.open()
        assert adapter.publish_batch([job])[0].outcome is models.Outcome.PUBLISHED
        channel = connection.channel()
        # Declaring it again is accepted only with the same x-queue-type (else 406 inequivalent arg).
        declared = channel.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
        assert declared.method.message_count == 1
    finally:
        adapter.close()
        connection.close()
        rabbit.delete_queues(rabbit.SHARED_URL, queue)
