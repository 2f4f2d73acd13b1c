"""Celery: the drain end to end against Celery's own ``app.send_task`` with confirms, same run.

send_task  ``app.send_task("app.tasks.bench", args, task_id=..., queue=...)`` in a loop, the
           library's own path: on RabbitMQ with ``broker_transport_options = {"confirm_publish":
           True}`` (it waits for each confirm), on Redis one acknowledged LPUSH per task.
drain      Relay.drain_step() (the pipelined loop of ``drain run``) from N staged rows until the
           table is empty and nothing is in flight, to the same broker and queue.
rabbitmq   On RabbitMQ, the same N rows drained again through the drain's own ``rabbitmq`` backend
           (raw AMQP messages, publisher confirms) to the same queue: what Celery's message
           format and kombu cost the drain against its plainest AMQP path.

Usage: python bench/bench_celery.py [--rows 50000] [--send 10000] [--broker amqp|redis|both]
       [--batch-size 500] [--pipeline-depth 4] [--dsn postgresql://postgres@127.0.0.1:5432/postgres]
       [--amqp amqp://guest:guest@127.0.0.1:5672//] [--redis redis://127.0.0.1:6379]

Creates a database and a queue with unique names and drops both at the end; on Redis it claims a
free db index with the tests' marker key and deletes only the keys it made. Targets on RabbitMQ:
drain >= 4 x send_task; drain -> Celery / drain -> the rabbitmq backend >= 0.8 (issue 35).
"""

from __future__ import annotations

import argparse
import time
import uuid

import celery
import pika
import psycopg

from drain import config
from drain.store import session as store

try:
    from bench import benchkit
except ImportError:  # run as a file: this folder is on sys.path
    import benchkit  # type: ignore[no-redef]

ARGS = ["x" * 150]
TASK = "app.tasks.bench"
CELERY_OVER_RABBITMQ_TARGET = 0.8  # issue 35: drain -> Celery / drain -> the rabbitmq backend


def send_task_rate(broker_url: str, queue: str, count: int, confirm: bool) -> float:
    app = celery.Celery("bench", broker=broker_url, set_as_current=False)
    if confirm:
        app.conf.broker_transport_options = {"confirm_publish": True}
    try:
        app.send_task(TASK, ARGS, task_id=str(uuid.uuid4()), queue=queue)  # connect, declare
        started = time.perf_counter()
        for _ in range(count):
            app.send_task(TASK, ARGS, task_id=str(uuid.uuid4()), queue=queue)
        return count / (time.perf_counter() - started)
    finally:
        app.close()


def drain_rate(
    dsn: str, broker_url: str, queue: str, rows: int, batch_size: int, depth: int, kind: str = "celery"
) -> float:
    """Stage ``rows`` jobs, then drain them through a backend of ``kind`` (``celery``, or the
    drain's own ``rabbitmq`` with ``broker_url`` as pika spells it); return jobs per second."""
    benchkit.stage_rows(dsn, TASK, ARGS, queue, rows)
    if kind == "celery":
        options: dict[str, object] = {"broker_url": broker_url, "allowed_jobs": ["app.tasks.*"]}
    else:
        options = {"url": broker_url}
    settings = config.Settings(
        dsn=dsn,
        batch_size=batch_size,
        pipeline_depth=depth,
        publish_timeout_s=30,
        backends={"bench": config.BackendSettings("bench", kind, 10, options)},
    )
    return rows / benchkit.timed_drain(settings, rows)


def run_amqp(args: argparse.Namespace, dsn: str, queue: str) -> tuple[float, float, float]:
    """send_task's rate, the drain's through Celery, and the drain's through the rabbitmq backend
    (the same rows, the same queue, one after the other)."""
    # Celery spells the default vhost "//", pika "/%2F"
    pika_url = args.amqp[:-2] + "/%2F" if args.amqp.endswith("//") else args.amqp
    connection = pika.BlockingConnection(pika.URLParameters(pika_url))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)
    try:
        sent = send_task_rate(args.amqp, queue, args.send, confirm=True)
        channel.queue_purge(queue)
        drained = drain_rate(dsn, args.amqp, queue, args.rows, args.batch_size, args.pipeline_depth)
        held = channel.queue_declare(queue, passive=True).method.message_count
        if held != args.rows:
            raise SystemExit(f"the queue holds {held} of {args.rows}")
        channel.queue_purge(queue)
        plain = drain_rate(dsn, pika_url, queue, args.rows, args.batch_size, args.pipeline_depth, "rabbitmq")
        held = channel.queue_declare(queue, passive=True).method.message_count
        if held != args.rows:
            raise SystemExit(f"the queue holds {held} of {args.rows} (rabbitmq backend)")
        return sent, drained, plain
    finally:
        channel.queue_delete(queue)
        channel.exchange_delete(queue)  # send_task declared an exchange named after the queue
        connection.close()


def run_redis(args: argparse.Namespace, dsn: str, queue: str) -> tuple[float, float, float]:
    url, client = benchkit.claim_redis_db(args.redis)
    before = set(client.keys("*"))
    try:
        sent = send_task_rate(url, queue, args.send, confirm=False)
        client.delete(queue)
        drained = drain_rate(dsn, url, queue, args.rows, args.batch_size, args.pipeline_depth)
        held = client.llen(queue)
        if held != args.rows:
            raise SystemExit(f"the list holds {held} of {args.rows}")
        return sent, drained, float("nan")
    finally:
        created = set(client.keys("*")) - before
        if created:
            client.delete(*created)
        benchkit.release_redis_db(client)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--send", type=int, default=10_000, help="tasks sent with send_task")
    parser.add_argument("--broker", choices=["amqp", "redis", "both"], default="both")
    parser.add_argument("--batch-size", type=int, default=config.DEFAULT_BATCH_SIZE)
    parser.add_argument("--pipeline-depth", type=int, default=config.PIPELINE_DEPTH)
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    args = parser.parse_args()

    brokers = ["amqp", "redis"] if args.broker == "both" else [args.broker]
    admin = psycopg.connect(args.dsn, autocommit=True)
    try:
        for broker in brokers:
            suffix = uuid.uuid4().hex[:10]
            database, queue = f"drain_bench_{suffix}", f"drain-bench-{suffix}"
            admin.execute(f'CREATE DATABASE "{database}"')
            dsn = psycopg.conninfo.make_conninfo(args.dsn, dbname=database)
            try:
                db = store.Store(config.Settings(dsn=dsn))
                db.migrate()
                db.close()
                sent, drained, plain = (run_amqp if broker == "amqp" else run_redis)(args, dsn, queue)
            finally:
                admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            what = "RabbitMQ, send_task with confirm_publish" if broker == "amqp" else "Redis, send_task"
            print(f"{what} ({args.send:,} tasks): {sent:,.0f} tasks/s")
            print(
                f"  drain end to end (batch {args.batch_size}, pipeline depth {args.pipeline_depth}, "
                f"{args.rows:,} rows): {drained:,.0f} jobs/s"
            )
            target = " (target >= 4)" if broker == "amqp" else ""
            print(f"  ratio drain / send_task: {drained / sent:.1f}{target}")
            if broker == "amqp":
                print(f"  drain end to end, rabbitmq backend, same rows and queue: {plain:,.0f} jobs/s")
                print(
                    f"  ratio drain -> Celery / drain -> rabbitmq backend: {drained / plain:.2f}"
                    f" (target >= {CELERY_OVER_RABBITMQ_TARGET})"
                )
    finally:
        admin.close()


if __name__ == "__main__":
    main()
