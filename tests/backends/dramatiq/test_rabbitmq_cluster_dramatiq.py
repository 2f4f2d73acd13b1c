"""G1 G10 for Dramatiq on a RabbitMQ cluster: a memory alarm is an outage until it clears, and the
node the drain is connected to is SIGKILLed under load; the drain moves to the other node by
itself. lost 0, dead 0.

Two private nodes (tests.support.rabbit.PrivateCluster; about 20 s to form here, so two short
cases; the kill runs last). Dramatiq declares classic queues, which live on one node: the test's
queue is declared on the surviving node first (with Dramatiq's arguments), and the drain's
``url`` lists the victim first, so it publishes through the victim until the kill. The jobs are
counted on the survivor by the message id in each body (Dramatiq sets no AMQP ``message_id``).
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from drain_adapters import dramatiq
from drain_adapters.dramatiq import rabbitmq_link

from drain import errors, models
from tests.support import configs, faultload, jobs, ledger, processes, rabbit
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[rabbit.PrivateCluster]:
    with rabbit.private_cluster(tmp_path_factory.mktemp("cluster"), 2) as nodes:
        yield nodes


def held(url: str, queue: str) -> collections.Counter[uuid.UUID]:
    """Consume what ``queue`` holds: how many messages carry each message id."""
    counted: collections.Counter[uuid.UUID] = collections.Counter()
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        while True:
            method, _properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return counted
            counted[uuid.UUID(json.loads(body)["message_id"])] += 1
    finally:
        connection.close()


def test_a_memory_alarm_is_an_outage_until_it_clears(cluster: rabbit.PrivateCluster) -> None:
    """A node's memory alarm blocks every publisher of the cluster (``connection.blocked``): the
    batch is the backend's outage (rows wait, none rejected), and the same adapter publishes
    again once the alarm clears."""
    node = cluster.nodes[1]
    queue = "dramatiq_alarm"
    options = {"url": [node.url], "allowed_actors": ["app.record"], "connect_timeout_s": 2.0}
    adapter = dramatiq.DramatiqAdapter.from_options("alarm", options, publish_timeout_s=3.0)
    try:
        adapter.open()
        assert (
            adapter.publish_batch([jobs.staged(1, queue, "app.record")])[0].outcome
            is models.Outcome.PUBLISHED
        )
        node.set_memory_watermark(0)
        try:
            with pytest.raises(errors.BackendUnavailable, match=r"blocks publishing|blocked|probe"):
                adapter.publish_batch([jobs.staged(i, queue, "app.record") for i in range(2, 6)])
        finally:
            node.set_memory_watermark(0.4)
        adapter.close()
        wait_until("the alarm to clear", lambda: _publishes(adapter, queue), 60)
    finally:
        adapter.close()
    assert sum(held(node.url, queue).values()) >= 2
    rabbit.delete_queues(node.url, queue, f"{queue}.DQ", f"{queue}.XQ")


def _publishes(adapter: dramatiq.DramatiqAdapter, queue: str) -> bool:
    try:
        adapter.open()
        return (
            adapter.publish_batch([jobs.staged(9, queue, "app.record")])[0].outcome
            is models.Outcome.PUBLISHED
        )
    except errors.BackendUnavailable:
        adapter.close()
        return False


def test_killing_the_node_the_drain_is_connected_to_loses_nothing(
    cluster: rabbit.PrivateCluster, database: str, tmp_path: Path
) -> None:
    victim, survivor = cluster.nodes
    queue = "dramatiq_cluster"
    connection = pika.BlockingConnection(pika.URLParameters(survivor.url))
    for name, arguments in rabbitmq_link.declarations(queue, None, 604_800_000):
        connection.channel().queue_declare(name, durable=True, arguments=arguments)
    connection.close()
    faultload.prepare(database)
    backend = {
        "type": "dramatiq",
        "url": [victim.url, survivor.url],
        "allowed_actors": [faultload.JOB_NAME],
        "publish_timeout_s": 5.0,
        "connect_timeout_s": 2.0,
    }
    config = configs.write_config(tmp_path / "drain.toml", database, {"default": backend}, batch_size=50)
    drain = processes.start_drain(config, None, tmp_path / "drain.log")
    load = faultload.load(database, queue=queue)

    def kill_the_victim() -> float:
        assert "(node 1 of 2)" in drain.output(), "the drain is not on the first node"
        victim.kill()
        return time.time()

    recovery = faultload.fault_under_load(database, drain, load, kill_the_victim)
    result = ledger.tally(database, held(survivor.url, queue), load.rolled_back)
    faultload.report(
        "rabbitmq cluster: the drain's node SIGKILLed (Dramatiq)", result, recovery_s=f"{recovery:.2f}"
    )
    result.check()
    assert not result.dead
    assert "(node 2 of 2)" in drain.output(), "the drain did not move to the survivor"
