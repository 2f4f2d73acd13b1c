"""RabbitMQ: the drain end to end against the raw pika limit, measured in the same run.

raw    pika SelectConnection, publisher confirms, up to WINDOW messages unconfirmed (streaming,
       no batch barrier), persistent ~300 B messages with the drain's properties to a durable
       queue, no database.
drain  Relay.drain_step() (the pipelined loop of `drain run`) from N staged rows until the table
       is empty and nothing is in flight; same queue, same messages.

Usage: python bench/bench_rabbitmq.py [--rows 100000] [--batch-size 500] [--pipeline-depth 4]
       [--dsn postgresql://postgres@127.0.0.1:5432/postgres] [--amqp amqp://guest:guest@127.0.0.1:5672/%2F]

Creates a database and a queue with unique names and drops both at the end. Target: ratio >= 1.2 (issue 35).
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

import pika
import psycopg
from drain_adapters import rabbitmq

from drain import config
from drain.store import session as store

try:
    from bench import benchkit
except ImportError:  # run as a file: this folder is on sys.path
    import benchkit  # type: ignore[no-redef]

WINDOW = 2000
ARGS = ["x" * 150]


def raw_publish(url: str, queue: str, count: int) -> float:
    """Publish ``count`` messages with confirms, WINDOW outstanding; return messages per second."""
    body = json.dumps(
        {
            "job_id": str(uuid.uuid4()),
            "job_name": "app.tasks.bench",
            "args": ARGS,
            "kwargs": {},
            "queue": queue,
            "created_at": "2024-01-01T00:00:00+00:00",
            "options": {},
        }
    ).encode()
    state = {"sent": 0, "acked": 0, "started": 0.0, "elapsed": 0.0}
    channel_box: list[Any] = []

    def pump() -> None:
        channel = channel_box[0]
        while state["sent"] < count and state["sent"] - state["acked"] < WINDOW:
            properties = pika.BasicProperties(  # the properties the drain sets (SPEC §7)
                content_type="application/json",
                delivery_mode=2,
                message_id=str(uuid.uuid4()),
                type="app.tasks.bench",
                timestamp=int(time.time()),
            )
            channel.basic_publish("", queue, body, properties, mandatory=True)
            state["sent"] += 1

    def on_confirm(frame: Any) -> None:
        tag = frame.method.delivery_tag
        state["acked"] = tag if frame.method.multiple else max(state["acked"], tag)
        if state["acked"] >= count:
            state["elapsed"] = time.perf_counter() - state["started"]
            connection.close()
            return
        pump()

    def on_confirm_mode(_frame: Any) -> None:
        state["started"] = time.perf_counter()
        pump()

    def on_channel(channel: Any) -> None:
        channel_box.append(channel)
        channel.confirm_delivery(ack_nack_callback=on_confirm, callback=on_confirm_mode)

    connection = pika.SelectConnection(
        pika.URLParameters(url),
        on_open_callback=lambda conn: conn.channel(on_open_callback=on_channel),
        on_close_callback=lambda conn, reason: conn.ioloop.stop(),
    )
    connection.ioloop.start()
    return count / state["elapsed"]


def drain_end_to_end(dsn: str, url: str, queue: str, rows: int, batch_size: int, depth: int) -> float:
    """Stage ``rows`` jobs, then drain them with the Relay; return jobs per second."""
    benchkit.stage_rows(dsn, "app.tasks.bench", ARGS, queue, rows)
    settings = config.Settings(
        dsn=dsn,
        batch_size=batch_size,
        pipeline_depth=depth,
        publish_timeout_s=30,
        backends={"bench": config.BackendSettings("bench", "rabbitmq", 10, {"url": url})},
    )
    return rows / benchkit.timed_drain(settings, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=config.DEFAULT_BATCH_SIZE)
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--amqp", default=rabbitmq.DEFAULT_URL)
    parser.add_argument("--pipeline-depth", type=int, default=config.PIPELINE_DEPTH)
    args = parser.parse_args()

    suffix = uuid.uuid4().hex[:10]
    queue = f"drain-bench-{suffix}"
    database = f"drain_bench_{suffix}"
    admin = psycopg.connect(args.dsn, autocommit=True)
    admin.execute(f'CREATE DATABASE "{database}"')
    bench_dsn = psycopg.conninfo.make_conninfo(args.dsn, dbname=database)
    connection = pika.BlockingConnection(pika.URLParameters(args.amqp))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)
    try:
        db = store.Store(config.Settings(dsn=bench_dsn))
        db.migrate()
        db.close()
        raw = raw_publish(args.amqp, queue, args.rows)
        channel.queue_purge(queue)
        end_to_end = drain_end_to_end(
            bench_dsn, args.amqp, queue, args.rows, args.batch_size, args.pipeline_depth
        )
        depth = channel.queue_declare(queue, passive=True).method.message_count
        print(f"raw pika confirms (window {WINDOW}): {raw:,.0f} msg/s")
        print(
            f"drain end to end (batch {args.batch_size}, pipeline depth {args.pipeline_depth}, "
            f"{args.rows:,} rows): {end_to_end:,.0f} jobs/s"
        )
        print(f"ratio: {end_to_end / raw:.2f} (target >= 1.2); queue held {depth:,} of {args.rows:,}")
    finally:
        channel.queue_delete(queue)
        connection.close()
        admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        admin.close()


if __name__ == "__main__":
    main()
