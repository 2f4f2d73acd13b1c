"""The RabbitMQ backend and Celery on AMQP against a real three-node RabbitMQ cluster with quorum
queues, started by this module on private loopback ports (tests.support.rabbit.PrivateCluster).

One cluster serves the module (it takes seconds to form); each test uses queues of its own, and
the test that kills a node runs last. An in-process drain forwards to both backends at once:
``rmq`` (``url`` = the three nodes, a list) and ``cel`` (Celery's ``;``-separated ``broker_url``).
Counted with pika on a surviving node (``message_id`` for the RabbitMQ backend, the task id in
``correlation_id`` for Celery) against the committed ids and the dead-letter table: lost must be
0. A quorum queue confirms a publish once a majority of its members has it, so a confirmed job
survives the death of any one node.

The cluster's ``max_message_size`` is 64 KiB, so one test can send a message it refuses.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator

import pika
import psycopg
import pytest

import drain
from drain import config
from drain.relay import loop as relay
from drain.relay import settle
from tests.support import ledger, rabbit
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

RMQ, CEL = "rmq", "cel"
MAX_MESSAGE_BYTES = 65_536
QUORUM = {"x-queue-type": "quorum"}
DEADLINE_S = 120.0
FULL_AT = 10  # x-max-length of the full queue
FILLER = "filler-"
PRODUCER_PAUSE_S = 0.05
ALARM_S = 9.0  # long enough for several paused retries (0.5 s doubling), each reconnecting


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[rabbit.PrivateCluster]:
    started = time.monotonic()
    base = tmp_path_factory.mktemp("cluster")
    with rabbit.private_cluster(base, 3, config=f"max_message_size = {MAX_MESSAGE_BYTES}\n") as nodes:
        print(f"\nthree-node cluster formed in {time.monotonic() - started:.1f}s")
        yield nodes


def celery_url(url: str) -> str:
    return url.replace("/%2F", "//")  # Celery's spelling of the default vhost


def two_backends(
    database: str, cluster: rabbit.PrivateCluster, max_attempts: int = 10, **overrides: object
) -> config.Settings:
    """An in-process drain's settings: ``rmq`` and ``cel`` on every node of the cluster."""
    nodes = cluster.urls
    rmq = {"url": nodes, "connect_timeout_s": 2.0}
    cel = {
        "broker_url": ";".join(celery_url(url) for url in nodes),
        "allowed_jobs": ["app.**"],
        "connect_timeout_s": 2.0,
    }
    base = rabbit.drain_settings(database, RMQ, rmq, publish_timeout_s=5.0, **overrides)
    backends = {
        RMQ: config.BackendSettings(RMQ, "rabbitmq", max_attempts, rmq),
        CEL: config.BackendSettings(CEL, "celery", max_attempts, cel),
    }
    return dataclasses.replace(base, backends=backends)


def backend_up(the_relay: relay.Relay, name: str) -> float | None:
    value: float | None = the_relay.metrics.registry.get_sample_value("drain_backend_up", {"backend": name})
    return value


def scalar(database: str, query: str) -> object:
    with psycopg.connect(database) as conn:
        row = conn.execute(query).fetchone()  # type: ignore[arg-type]
        return None if row is None else row[0]


def dead_ids(database: str) -> set[str]:
    with psycopg.connect(database) as conn:
        return {str(row[0]) for row in conn.execute("SELECT job_id FROM staged_jobs_dead")}


def tally(committed: set[str], delivered: collections.Counter[str], database: str) -> ledger.Tally:
    return ledger.Tally(
        {uuid.UUID(i) for i in committed},
        collections.Counter({uuid.UUID(i): n for i, n in delivered.items() if not i.startswith(FILLER)}),
        {uuid.UUID(i) for i in dead_ids(database)},
        remaining=rabbit.staged_count(database),
    )


def fill(url: str, queue: str, count: int) -> None:
    """Publish ``count`` messages that are no job (their ids say so), one confirm at a time."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for n in range(count):
            body = json.dumps({"job_id": f"{FILLER}{n}"}).encode()
            properties = pika.BasicProperties(message_id=f"{FILLER}{n}", delivery_mode=2)
            channel.basic_publish("", queue, body, properties, mandatory=True)
    finally:
        connection.close()


def unavailable_streak(caplog: pytest.LogCaptureFixture, name: str) -> int:
    """How many times in a row the drain found ``name`` unavailable (its pause streak)."""
    records = [r for r in caplog.records if getattr(r, "event", None) == "backend_unavailable"]
    return max(
        (int(getattr(r, "attempts", 0)) for r in records if getattr(r, "backend", None) == name), default=0
    )


def test_a_memory_alarm_holds_every_row_without_counting_an_attempt(
    cluster: rabbit.PrivateCluster, database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A resource alarm blocks publishers cluster-wide (``connection.blocked``): a whole-backend
    refusal, so the rows wait untouched through several retries, and forwarding resumes alone.
    The alarm lasts ALARM_S, through several reconnections: each proves the broker takes a
    publish before it risks a batch, so no job arrives more than twice (the one extra copy is a
    batch the broker read as the alarm began)."""
    caplog.set_level(logging.INFO)
    alarmed, other = cluster.nodes[0], cluster.nodes[1]
    rmq_q, cel_q = rabbit.unique_name("alarm"), rabbit.unique_name("alarm-celery")
    with rabbit.queues(other.url, rmq_q, cel_q, arguments=QUORUM):
        with rabbit.running_relay(two_backends(database, cluster)) as the_relay:
            first = rabbit.stage_jobs(database, 100, (rmq_q,), RMQ) | rabbit.stage_jobs(
                database, 100, (cel_q,), CEL
            )
            wait_until("the first jobs", lambda: rabbit.staged_count(database) == 0, DEADLINE_S)
            alarmed.set_memory_watermark(0)
            began = time.monotonic()
            try:
                second_rmq = rabbit.stage_jobs(database, 200, (rmq_q,), RMQ)
                second_cel = rabbit.stage_jobs(database, 200, (cel_q,), CEL)
                wait_until(
                    f"both backends to be found blocked three times in a row, {ALARM_S:.0f}s into the alarm",
                    lambda: (
                        min(unavailable_streak(caplog, RMQ), unavailable_streak(caplog, CEL)) >= 3
                        and time.monotonic() - began >= ALARM_S
                    ),
                    DEADLINE_S,
                )
                assert (backend_up(the_relay, RMQ), backend_up(the_relay, CEL)) == (0, 0)
                assert rabbit.staged_count(database) == 400, "a job went out under the alarm"
                assert scalar(database, "SELECT coalesce(sum(attempts), 0) FROM staged_jobs") == 0
                assert dead_ids(database) == set()
                assert "blocks publishing" in caplog.text
            finally:
                alarmed.set_memory_watermark(0.4)
            wait_until("forwarding to resume", lambda: rabbit.staged_count(database) == 0, DEADLINE_S)
            assert (backend_up(the_relay, RMQ), backend_up(the_relay, CEL)) == (1, 1)
        rmq_held = rabbit.take_counts(other.url, (rmq_q,))
        cel_held = rabbit.take_counts(other.url, (cel_q,), by="correlation_id")
    counted = tally(first | second_rmq | second_cel, rmq_held + cel_held, database)
    print(counted)
    counted.check()
    assert not counted.dead
    assert counted.max_runs <= 2, f"a job arrived more than twice through one alarm: {counted}"


def test_a_full_queue_waits_uncounted_while_the_other_queues_flow(
    cluster: rabbit.PrivateCluster, database: str
) -> None:
    """``x-max-length`` with ``x-overflow = reject-publish`` nacks what does not fit: that
    queue's rows RETRY with a growing delay and no attempt counted while the other queue's rows
    are all delivered, and once a consumer makes room the held rows go too.

    The full queue is a classic one: a quorum queue enforces reject-publish only once the
    publishing channel learns the queue is over its limit (it learns from the queue's answer),
    so a pipelined batch overshoots it and only later ones are nacked.
    """
    node = cluster.nodes[1]
    full, free = rabbit.unique_name("full"), rabbit.unique_name("free")
    bounded = {"x-max-length": FULL_AT, "x-overflow": "reject-publish"}
    with rabbit.queues(node.url, full, arguments=bounded), rabbit.queues(node.url, free, arguments=QUORUM):
        fill(node.url, full, FULL_AT)
        committed = rabbit.stage_jobs(database, 80, (full, free), RMQ)  # alternating: 40 each
        settings = rabbit.drain_settings(database, RMQ, {"url": cluster.urls}, publish_timeout_s=5.0)
        waiting = f"SELECT count(*) FROM staged_jobs WHERE queue = '{full}' AND attempts = 0"
        pushed_back_s = "SELECT coalesce(extract(epoch FROM max(run_at) - now()), 0)::float8 FROM staged_jobs"
        with rabbit.running_relay(settings):
            wait_until(
                "the free queue's 40 jobs to go while the full queue's wait",
                lambda: (
                    rabbit.staged_count(database) == scalar(database, waiting)
                    and rabbit.staged_count(database) >= 30
                ),
                DEADLINE_S,
            )
            wait_until(
                "a longer wait for a queue that keeps refusing",
                lambda: float(scalar(database, pushed_back_s)) > settle.NACK_DELAY_S * 2,
                DEADLINE_S,
            )
            assert (
                scalar(database, "SELECT count(*) FROM staged_jobs WHERE last_error NOT LIKE '%nacked%'") == 0
            )
            assert dead_ids(database) == set()
            with rabbit.Consumer(node.url, (full,)) as consumer:
                wait_until("room in the full queue", lambda: rabbit.staged_count(database) == 0, DEADLINE_S)
                wait_until("the consumer", lambda: len(set(consumer.received)) >= 40 + FULL_AT, DEADLINE_S)
            assert consumer.error is None and consumer.mismatched == []
        held = rabbit.take_counts(node.url, (free,)) + collections.Counter(consumer.received)
    counted = tally(committed, held, database)
    print(counted)
    counted.check()
    assert not counted.dead


def test_a_message_over_max_message_size_is_dead_lettered_and_its_neighbours_delivered(
    cluster: rabbit.PrivateCluster, database: str
) -> None:
    """RabbitMQ refuses an oversized message by closing the channel, failing every unconfirmed
    message on it: the oversized job counts its attempts and is dead-lettered after
    max_attempts; the jobs around it on the same channel are delivered."""
    node = cluster.nodes[1]
    rmq_q, cel_q = rabbit.unique_name("size"), rabbit.unique_name("size-celery")
    big: dict[str, str] = {}
    committed: set[str] = set()
    with rabbit.queues(node.url, rmq_q, cel_q, arguments=QUORUM):
        with psycopg.connect(database) as conn:
            for name, queue in ((RMQ, rmq_q), (CEL, cel_q)):
                jobs = [drain.Job("app.tasks.record", args=[n], queue=queue, backend=name) for n in range(20)]
                jobs.insert(
                    10,
                    drain.Job("app.tasks.record", args=["x" * MAX_MESSAGE_BYTES], queue=queue, backend=name),
                )
                ids = [str(i) for i in drain.stage_many(conn, jobs)]  # one batch: neighbours on one channel
                big[name] = ids.pop(10)
                committed.update(ids)
            conn.commit()
        with rabbit.running_relay(two_backends(database, cluster, max_attempts=3)):
            wait_until("the batch to settle", lambda: rabbit.staged_count(database) == 0, DEADLINE_S)
        rmq_held = rabbit.take_counts(node.url, (rmq_q,))
        cel_held = rabbit.take_counts(node.url, (cel_q,), by="correlation_id")
    assert dead_ids(database) == set(big.values())
    with psycopg.connect(database) as conn:
        dead = conn.execute("SELECT attempts, error FROM staged_jobs_dead").fetchall()
    assert all(
        attempts == 3 and ("max_message_size" in error or "max size" in error) for attempts, error in dead
    ), dead
    counted = tally(committed, rmq_held + cel_held, database)
    print(counted)
    counted.check()
    assert not set(big.values()) & {str(i) for i in counted.delivered}


class Producer(threading.Thread):
    """Stages ``per_round`` jobs for each backend every PRODUCER_PAUSE_S until stopped; keeps
    the committed ids."""

    def __init__(self, database: str, rmq_queues: tuple[str, ...], cel_queue: str, per_round: int) -> None:
        super().__init__(name="producer", daemon=True)
        self.database, self.rmq_queues, self.cel_queue, self.per_round = (
            database,
            rmq_queues,
            cel_queue,
            per_round,
        )
        self.committed: set[str] = set()
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(PRODUCER_PAUSE_S):
            self.committed |= rabbit.stage_jobs(self.database, self.per_round, self.rmq_queues, RMQ)
            self.committed |= rabbit.stage_jobs(self.database, self.per_round // 2, (self.cel_queue,), CEL)

    def stop(self) -> set[str]:
        self.stopped.set()
        self.join(timeout=60)
        return self.committed


def test_killing_the_node_the_drain_is_connected_to_loses_nothing(
    cluster: rabbit.PrivateCluster, database: str
) -> None:
    """SIGKILL of the node both backends are connected to while jobs keep being staged: they
    move to the next node; every committed job is in its quorum queue afterwards, nothing
    dead-lettered. Runs last: the node stays dead."""
    victim, survivor = cluster.nodes[0], cluster.nodes[1]
    rmq_qs = (rabbit.unique_name("kill0"), rabbit.unique_name("kill1"))
    cel_q = rabbit.unique_name("kill-celery")
    with rabbit.queues(survivor.url, *rmq_qs, cel_q, arguments=QUORUM):
        producer = Producer(database, rmq_qs, cel_q, per_round=60)
        with rabbit.running_relay(two_backends(database, cluster)) as the_relay:
            producer.start()
            try:
                wait_until(
                    "both backends forwarding through the first node",
                    lambda: rabbit.sockets_to(victim.port) == 2 and len(producer.committed) >= 1_000,
                    DEADLINE_S,
                )
                victim.kill()
                at_kill = len(producer.committed)
                wait_until(
                    "more jobs staged after the kill",
                    lambda: len(producer.committed) >= at_kill + 1_000,
                    DEADLINE_S,
                )
            finally:
                committed = producer.stop()
            wait_until("the rest to drain", lambda: rabbit.staged_count(database) == 0, DEADLINE_S)
            assert (backend_up(the_relay, RMQ), backend_up(the_relay, CEL)) == (1, 1)
            assert rabbit.sockets_to(victim.port) == 0
        rmq_held = rabbit.take_counts(survivor.url, rmq_qs)
        cel_held = rabbit.take_counts(survivor.url, (cel_q,), by="correlation_id")
    counted = tally(committed, rmq_held + cel_held, database)
    print(f"staged before the kill {at_kill}: {counted}")
    counted.check()
    assert not counted.dead
