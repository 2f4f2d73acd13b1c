"""RabbitMQ: the drain end to end against the raw pika limit, measured in the same run.

raw    pika SelectConnection, publisher confirms, up to WINDOW messages unconfirmed (streaming,
       no batch barrier), persistent ~300 B messages with the drain's properties to a durable
       queue, no database.
drain  Relay.drain_step() (the pipelined loop of `drain run`) from N staged rows until the table
       is empty and nothing is in flight; same queue, same messages.
producers
       The same N rows staged again and drained by a fresh relay while a producer process commits
       ``--producers-rate`` transactions a second (100), each staging one job to the same queue
       (open loop: each commit has its time in a schedule). The clock runs from the first step
       until the steps have forwarded N jobs (the backlog's rows come first: the select takes the
       lowest ids), then the producer stops and the rest is drained, untimed. The figure is this
       time over the drain's time above (the same rows, no producers): a backlog's steps paying
       for the producers' commit flushes beside the broker's own writes.

Usage: python bench/bench_rabbitmq.py [--rows 100000] [--batch-size 500] [--pipeline-depth 4]
       [--producers-rate 100] [--dsn postgresql://postgres@127.0.0.1:5432/postgres]
       [--amqp amqp://guest:guest@127.0.0.1:5672/%2F]

Creates a database and a queue with unique names and drops both at the end. Targets (issue 35):
ratio >= 1.2; the backlog's time with producers / without <= 1.3.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
import uuid
from typing import Any

import pika
import psycopg
from drain_adapters import rabbitmq

import drain
from drain import backend, config
from drain.relay import loop as relay
from drain.store import session as store

try:
    from bench import benchkit
except ImportError:  # run as a file: this folder is on sys.path
    import benchkit  # type: ignore[no-redef]

WINDOW = 2000
ARGS = ["x" * 150]
JOB_NAME = "app.tasks.bench"
TARGET_RATIO = 1.2  # issue 35: drain / raw pika with confirms
PRODUCERS_RATE = 100.0
TARGET_PRODUCERS = 1.3  # issue 35: the backlog's time with producers / without
PRODUCER_START_S = 30.0


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


def drain_settings(dsn: str, url: str, batch_size: int, depth: int) -> config.Settings:
    return config.Settings(
        dsn=dsn,
        batch_size=batch_size,
        pipeline_depth=depth,
        publish_timeout_s=30,
        backends={"bench": config.BackendSettings("bench", "rabbitmq", 10, {"url": url})},
    )


def drain_end_to_end(settings: config.Settings, queue: str, rows: int) -> float:
    """Stage ``rows`` jobs, then drain them with the Relay; return the seconds it took."""
    benchkit.stage_rows(settings.dsn, JOB_NAME, ARGS, queue, rows)
    return benchkit.timed_drain(settings, rows)


def produce(dsn: str, queue: str, rate: float, stop: Any, committed: Any) -> None:
    """A producer process: one transaction staging one job every 1/``rate`` s, on a schedule
    (a late commit does not push the next ones back), until ``stop`` is set."""
    with psycopg.connect(dsn) as conn:
        due = time.monotonic()
        while not stop.is_set():
            drain.stage(conn, JOB_NAME, args=ARGS, queue=queue, backend="bench")
            conn.commit()
            with committed.get_lock():
                committed.value += 1
            due += 1 / rate
            stop.wait(max(0.0, due - time.monotonic()))


def drain_with_producers(settings: config.Settings, queue: str, rows: int, rate: float) -> tuple[float, int]:
    """Stage ``rows`` jobs, start a producer committing ``rate`` jobs/s to the same queue, and time
    a fresh relay's steps until they forwarded ``rows`` jobs; then stop the producer and drain the
    rest (untimed). Return (seconds, jobs the producer committed in all)."""
    benchkit.stage_rows(settings.dsn, JOB_NAME, ARGS, queue, rows)
    context = multiprocessing.get_context("spawn")
    stop, committed = context.Event(), context.Value("q", 0)
    producer = context.Process(target=produce, args=(settings.dsn, queue, rate, stop, committed))
    producer.start()
    adapters = backend.build_adapters(settings.backends, settings.publish_timeout_s)
    the_relay = relay.Relay(settings, adapters)
    try:
        benchkit.wait_for(lambda: committed.value > 0, PRODUCER_START_S, "the producer's first commit")
        assert the_relay.leadership.try_acquire()
        forwarded = 0
        started = time.perf_counter()
        while forwarded < rows:
            forwarded += the_relay.drain_step().published
        elapsed = time.perf_counter() - started
        stop.set()
        producer.join(PRODUCER_START_S)
        forwarded += benchkit.drain_until_empty(the_relay)
    finally:
        stop.set()
        the_relay.shutdown()
        producer.join(PRODUCER_START_S)
    if forwarded != rows + committed.value:
        raise SystemExit(f"forwarded {forwarded} of {rows} + {committed.value} rows")
    return elapsed, int(committed.value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=config.DEFAULT_BATCH_SIZE)
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--amqp", default=rabbitmq.DEFAULT_URL)
    parser.add_argument("--pipeline-depth", type=int, default=config.PIPELINE_DEPTH)
    parser.add_argument(
        "--producers-rate",
        type=float,
        default=PRODUCERS_RATE,
        help="commits/s while a backlog drains (0: skip)",
    )
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
        settings = drain_settings(bench_dsn, args.amqp, args.batch_size, args.pipeline_depth)
        alone_s = drain_end_to_end(settings, queue, args.rows)
        end_to_end = args.rows / alone_s
        depth = channel.queue_declare(queue, passive=True).method.message_count
        print(f"raw pika confirms (window {WINDOW}): {raw:,.0f} msg/s")
        print(
            f"drain end to end (batch {args.batch_size}, pipeline depth {args.pipeline_depth}, "
            f"{args.rows:,} rows): {end_to_end:,.0f} jobs/s"
        )
        print(
            f"ratio: {end_to_end / raw:.2f} (target >= {TARGET_RATIO}); "
            f"queue held {depth:,} of {args.rows:,}",
            flush=True,
        )
        if args.producers_rate > 0:
            channel.queue_purge(queue)
            rate = args.producers_rate
            with_s, produced = drain_with_producers(settings, queue, args.rows, rate)
            depth = channel.queue_declare(queue, passive=True).method.message_count
            if depth != args.rows + produced:
                raise SystemExit(f"the queue holds {depth} of {args.rows} + {produced}")
            print(
                f"backlog of {args.rows:,} rows while a producer commits {rate:g}/s: {with_s:.2f} s, "
                f"alone {alone_s:.2f} s ({produced:,} jobs produced, all forwarded)"
            )
            print(f"time with producers / without: {with_s / alone_s:.2f} (target <= {TARGET_PRODUCERS})")
    finally:
        channel.queue_delete(queue)
        connection.close()
        admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        admin.close()


if __name__ == "__main__":
    main()
