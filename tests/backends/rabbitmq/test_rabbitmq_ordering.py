"""Per-key order on RabbitMQ end to end (issue 25), with the backend's ``routing_key =
"ordering_key"``: a keyed job's routing key is its key, so the exchange keeps each key in one
queue, and one consumer per queue sees the key's jobs in staging (row id) order, each with its
key in the header ``x-ordering-key``. A job without a key keeps its queue as routing key.

- On the shared broker, a direct exchange with one binding per key (two queues, a static
  partition), 4 producers, 50 keys, a tenth of the jobs unkeyed; the drain refuses the first
  attempt of every fifth row (the ``refuse_first`` failpoint) and is SIGKILLed several times.
- On a private node with the consistent-hash exchange plugin (not enabled on the shared broker),
  the exchange the option is for: three queues of weight 1, the keys spread by hash.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from tests import conftest
from tests.support import configs, faultload, ledger, ordering, processes, rabbit
from tests.support.waiting import wait_until

JOBS = 2_000
KILLS = 4
CONSISTENT_HASH = "rabbitmq_consistent_hash_exchange"


@contextlib.contextmanager
def exchange(url: str, name: str, kind: str, bindings: dict[str, list[str]]) -> Iterator[str]:
    """A durable exchange of the test's own with ``bindings`` (queue -> binding keys), deleted
    at the end; the queues must exist."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.exchange_declare(name, exchange_type=kind, durable=True)
        for queue, keys in bindings.items():
            for key in keys:
                channel.queue_bind(queue, name, routing_key=key)
        yield name
    finally:
        with contextlib.suppress(Exception):
            connection.close()
        with contextlib.suppress(Exception):
            rabbit.delete_exchange(url, name)


def backend(url: str, exchange_name: str) -> dict[str, object]:
    return configs.rabbitmq(url, exchange=exchange_name, routing_key="ordering_key")


@pytest.mark.slow
def test_one_consumer_per_queue_sees_each_key_in_staging_order_through_refusals_and_kills(
    database: str, tmp_path: Path
) -> None:
    rabbit.need_rabbitmq()
    ledger.install(database)
    ordering.install(database)
    names = (rabbit.unique_name("keyed0"), rabbit.unique_name("keyed1"))
    partition = {names[0]: [names[0]], names[1]: []}  # the unkeyed jobs' queue by its name
    for index, key in enumerate(ordering.KEYS):
        partition[names[index % 2]].append(key)
    with (
        rabbit.queues(rabbit.SHARED_URL, *names),
        exchange(rabbit.SHARED_URL, rabbit.unique_name("by-key"), "direct", partition) as by_key,
        ordering.KeyedConsumer(rabbit.SHARED_URL, names) as consumer,
    ):
        config = configs.write_config(
            tmp_path / "drain.toml",
            database,
            {"default": backend(rabbit.SHARED_URL, by_key)},
            retry_base_s=0.5,
        )
        drains = ordering.DrainUnderKills(config, tmp_path, consumer.count, kills=KILLS, every=JOBS // 8)
        try:
            load = ordering.KeyedLoad(
                database, JOBS, queue=names[0], unkeyed_fraction=0.1, pace_s=(0.005, 0.03)
            ).start()
            drains.run_kills()
            result = load.join()
            wait_until(
                "every committed job to be consumed",
                lambda: set(ordering.counted(*consumer.received().values())) >= result.committed.keys(),
                180,
            )
            ledger.wait_drained(database)
        finally:
            drains.stop()
    received = consumer.received()
    tally = ledger.tally(database, ordering.counted(*received.values()), result.rolled_back)
    report = ordering.check_order(result.committed, received)
    faultload.report(f"rabbitmq per-key order by routing key, {drains.killed} kills", tally)
    print(f"order: {report}")

    tally.check()
    assert len(tally.committed) == len(result.committed) > JOBS // 2
    assert not tally.dead
    assert drains.killed == KILLS
    report.check()  # order per key, the right header, every key in one queue
    assert report.keys == len(ordering.KEYS)
    unkeyed = {job_id for job_id, (_row, key) in result.committed.items() if key is None}
    assert unkeyed and unkeyed <= {job_id for job_id, _ in received[names[0]]}
    refusable = {row_id for row_id, _key in result.committed.values() if row_id % ordering.REFUSE_EVERY == 0}
    assert refusable <= ordering.refused_rows(drains.logs), "a fifth of the rows were refused once"


@pytest.mark.slow
def test_a_consistent_hash_exchange_keeps_each_key_in_one_queue_in_order(
    database: str, tmp_path: Path
) -> None:
    if not rabbit.PrivateBroker.available():
        conftest.missing("the rabbitmq-server and erl binaries are not installed")
    ledger.install(database)
    ordering.install(database)
    broker = rabbit.PrivateBroker(tmp_path / "rabbit")
    (broker.base / "enabled_plugins").write_text(f"[{CONSISTENT_HASH}].\n")
    names = tuple(f"hashed{n}" for n in range(3))
    try:
        broker.start()
        with (
            rabbit.queues(broker.url, *names),
            exchange(broker.url, "by-hash", "x-consistent-hash", {name: ["1"] for name in names}) as by_hash,
            ordering.KeyedConsumer(broker.url, names) as consumer,
        ):
            config = configs.write_config(
                tmp_path / "drain.toml", database, {"default": backend(broker.url, by_hash)}
            )
            result = (
                ordering.KeyedLoad(
                    database, 600, queue="jobs", threads=2, unkeyed_fraction=0.05, rollback_fraction=0
                )
                .start()
                .join()
            )
            drain_process = processes.start_drain(config, None, tmp_path / "drain.log")
            with processes.running(drain_process):
                wait_until("every job to be consumed", lambda: consumer.count() >= len(result.committed), 120)
                ledger.wait_drained(database)
            received = consumer.received()
    finally:
        broker.stop()
    report = ordering.check_order(result.committed, received)
    print(f"order: {report}; per queue: {[len(seen) for seen in received.values()]}")
    report.check()  # each key in one queue, in order, with its header
    assert report.keys == len(ordering.KEYS)
    assert sum(1 for seen in received.values() if seen) > 1, "the keys were spread over the queues"
    assert ledger.tally(database, ordering.counted(*received.values())).lost == set()
