"""Dramatiq: the drain end to end against Dramatiq's own ``actor.send()``, same run.

send    ``actor.send(...)`` in a loop, the library's own path: on RabbitMQ with
        ``RabbitmqBroker(confirm_delivery=True)`` (it waits for each confirm: the only way
        ``send()`` knows the broker has the message), on Redis one script call per message
        (its reply is the acknowledgement).
drain   Relay.drain_step() (the pipelined loop of ``drain run``) from N staged rows until the
        table is empty and nothing is in flight, to the same broker and queue.

Both sides carry the same number of messages (``--rows``) to the same broker and queue, each
warmed up first, untimed: ``send()`` sends one message (connect, declare), the drain forwards one
row (connect, load its script or declare the queue, prepare its statements). They take turns
(``--rounds``: send a share, drain as many rows, and again), so a shared machine's load falls on
both; the queue is emptied between turns, the rows staged before each drain turn, untimed.

Usage: python bench/bench_dramatiq.py [--rows 20000] [--rounds 4] [--broker amqp|redis|both]
       [--batch-size 500] [--pipeline-depth 4] [--dsn postgresql://postgres@127.0.0.1:5432/postgres]
       [--amqp amqp://guest:guest@127.0.0.1:5672/%2F] [--redis redis://127.0.0.1:6379]

Creates a database and a queue with unique names and drops both at the end; on Redis it claims a
free db index with the tests' marker key and deletes only the keys it made. Target: drain >= 4 x
send on each broker.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable

import dramatiq
import pika
import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker

from drain import config
from drain.relay import loop as relay
from drain.store import session as store

try:
    from bench import benchkit
except ImportError:  # run as a file: this folder is on sys.path
    import benchkit  # type: ignore[no-redef]

ARGS = ["x" * 150]
ACTOR = "bench"
TARGET = 4.0


class Sender:
    """``actor.send()`` in a loop; its first message, untimed, connects and declares."""

    def __init__(self, broker: dramatiq.Broker, queue: str) -> None:
        self.broker = broker
        self.actor = dramatiq.Actor(
            lambda *a: None, actor_name=ACTOR, queue_name=queue, priority=0, broker=broker, options={}
        )
        self.actor.send(*ARGS)

    def timed(self, count: int) -> float:
        """Seconds to send ``count`` messages."""
        started = time.perf_counter()
        for _ in range(count):
            self.actor.send(*ARGS)
        return time.perf_counter() - started

    def close(self) -> None:
        self.broker.close()


def stage(dsn: str, queue: str, rows: int) -> None:
    benchkit.stage_rows(dsn, ACTOR, ARGS, queue, rows)


class Drainer:
    """The drain's turns: each a relay of its own (the loop of ``drain run``), since a leader left
    idle through a send() turn has its session ended by Postgres (idle_session_timeout)."""

    def __init__(self, dsn: str, url: str, queue: str, batch_size: int, depth: int) -> None:
        self.dsn, self.queue = dsn, queue
        options = {"url": url, "allowed_actors": [ACTOR]}
        self.settings = config.Settings(
            dsn=dsn,
            batch_size=batch_size,
            pipeline_depth=depth,
            publish_timeout_s=30,
            backends={"bench": config.BackendSettings("bench", "dramatiq", 10, options)},
        )

    def timed(self, rows: int, purge: Callable[[], object]) -> float:
        """Start a relay, forward one row untimed (connect, load the script or declare the queue,
        prepare the statements; ``purge`` then empties the queue), stage ``rows`` rows (untimed),
        and return the seconds to drain them."""

        def warm_up(the_relay: relay.Relay) -> None:
            stage(self.dsn, self.queue, 1)
            if benchkit.drain_until_empty(the_relay) != 1:
                raise SystemExit("the warm-up row was not forwarded")
            purge()
            stage(self.dsn, self.queue, rows)

        return benchkit.timed_drain(self.settings, rows, warm_up)


def measure(
    sender: Sender,
    drainer: Drainer,
    count: int,
    rounds: int,
    held: Callable[[], int],
    purge: Callable[[], object],
) -> tuple[float, float]:
    """(send()'s rate, the drain's) over ``count`` messages each, in ``rounds`` turns: what the
    machine's load does during the run, it does to both sides."""
    purge()  # the warm-up messages
    sent_s = drained_s = 0.0
    for turn in range(rounds):
        share = count // rounds + (1 if turn < count % rounds else 0)
        sent_s += sender.timed(share)
        purge()
        drained_s += drainer.timed(share, purge)
        if held() != share:
            raise SystemExit(f"the queue holds {held()} of {share}")
        purge()
    return count / sent_s, count / drained_s


def run_amqp(args: argparse.Namespace, dsn: str, queue: str) -> tuple[float, float]:
    connection = pika.BlockingConnection(pika.URLParameters(args.amqp))
    channel = connection.channel()
    names = (queue, f"{queue}.DQ", f"{queue}.XQ")
    sender = None
    try:
        sender = Sender(RabbitmqBroker(url=args.amqp, confirm_delivery=True), queue)
        return measure(
            sender,
            Drainer(dsn, args.amqp, queue, args.batch_size, args.pipeline_depth),
            args.rows,
            args.rounds,
            lambda: channel.queue_declare(queue, passive=True).method.message_count,
            lambda: channel.queue_purge(queue),
        )
    finally:
        if sender is not None:
            sender.close()
        for name in names:
            channel.queue_delete(name)
        connection.close()


def run_redis(args: argparse.Namespace, dsn: str, queue: str) -> tuple[float, float]:
    url, client = benchkit.claim_redis_db(args.redis)
    before = set(client.keys("*"))
    keys = (f"dramatiq:{queue}", f"dramatiq:{queue}.msgs")
    sender = None
    try:
        sender = Sender(RedisBroker(url=url), queue)
        return measure(
            sender,
            Drainer(dsn, url, queue, args.batch_size, args.pipeline_depth),
            args.rows,
            args.rounds,
            lambda: client.llen(keys[0]),
            lambda: client.delete(*keys),
        )
    finally:
        if sender is not None:
            sender.close()
        created = set(client.keys("*")) - before
        if created:
            client.delete(*created)
        benchkit.release_redis_db(client)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000, help="messages on each side")
    parser.add_argument("--rounds", type=int, default=4, help="turns of send() then the drain")
    parser.add_argument("--broker", choices=["amqp", "redis", "both"], default="both")
    parser.add_argument("--batch-size", type=int, default=config.DEFAULT_BATCH_SIZE)
    parser.add_argument("--pipeline-depth", type=int, default=config.PIPELINE_DEPTH)
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    args = parser.parse_args()

    brokers = ["amqp", "redis"] if args.broker == "both" else [args.broker]
    admin = psycopg.connect(args.dsn, autocommit=True)
    try:
        for broker in brokers:
            suffix = uuid.uuid4().hex[:10]
            database, queue = f"drain_bench_{suffix}", f"drain_bench_{suffix}"
            admin.execute(f'CREATE DATABASE "{database}"')
            dsn = psycopg.conninfo.make_conninfo(args.dsn, dbname=database)
            try:
                db = store.Store(config.Settings(dsn=dsn))
                db.migrate()
                db.close()
                sent, drained = (run_amqp if broker == "amqp" else run_redis)(args, dsn, queue)
            finally:
                admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            what = (
                "RabbitMQ, actor.send() with confirm_delivery" if broker == "amqp" else "Redis, actor.send()"
            )
            print(f"{what} ({args.rows:,} messages): {sent:,.0f} messages/s")
            print(
                f"  drain end to end (batch {args.batch_size}, pipeline depth {args.pipeline_depth}, "
                f"{args.rows:,} rows): {drained:,.0f} jobs/s"
            )
            print(f"  ratio drain / send: {drained / sent:.1f} (target >= {TARGET:g})")
    finally:
        admin.close()


if __name__ == "__main__":
    main()
