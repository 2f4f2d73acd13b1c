"""A consumer of the drain's NATS JetStream backend: a durable pull consumer that acks after the work.

    pip install nats-py psycopg
    python examples/nats_consumer.py --stream JOBS --durable workers --dsn postgresql://...

Each message is one job (docs/backends/nats.md): ``Nats-Msg-Id`` and the body's ``job_id`` are
its job id, ``Drain-Job-Name`` (and the body's ``job_name``) what to run. The consumer:

1. fetches a batch from a durable pull consumer (its position survives restarts, and several
   processes with the same ``--durable`` share the work);
2. runs each job and records its job id in ``processed_jobs`` in the same database transaction
   as the job's own writes;
3. acks the message only after that transaction committed. A crash before the ack makes
   JetStream deliver the message again after ``ack_wait``.

Duplicates: JetStream drops a re-publish whose ``Nats-Msg-Id`` it saw within the stream's
duplicate window (2 minutes by default), so the drain's own re-publishes after a crash are
stored once. A re-publish after the window (a drain down longer than the window between the
PubAck and its DELETE), and a redelivery after a missing ack, reach the consumer again with the
same job id: ``processed_jobs`` (its primary key) turns them into no-ops. Keep its rows at least
as long as a job can come back.

``--once`` stops when no message arrived for ``--idle-s`` (for tests and cron-style runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import nats
import nats.js.api
import psycopg

log = logging.getLogger("nats_consumer")

SCHEMA = """
CREATE TABLE IF NOT EXISTS processed_jobs (
    job_id       uuid PRIMARY KEY,
    job_name     text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now()
)
"""


def send_email(conn: psycopg.Connection[Any], address: str) -> None:
    """An example job: whatever it writes goes in ``conn``'s transaction."""
    log.info("sending mail to %s", address)


TASKS: dict[str, Callable[..., None]] = {"app.tasks.send_email": send_email}


def handle(conn: psycopg.Connection[Any], body: bytes) -> str:
    """Run one job once: 'done', 'duplicate' (its job id was processed already) or 'unknown'."""
    job = json.loads(body)
    task = TASKS.get(job["job_name"])
    if task is None:
        return "unknown"
    with conn.transaction():
        inserted = conn.execute(
            "INSERT INTO processed_jobs (job_id, job_name) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            [job["job_id"], job["job_name"]],
        ).rowcount
        if not inserted:
            return "duplicate"  # seen before: a re-publish after the window, or a redelivery
        task(conn, *job["args"], **job["kwargs"])
    return "done"


async def consume(args: argparse.Namespace) -> dict[str, int]:
    client = await nats.connect(args.url)
    counts = {"done": 0, "duplicate": 0, "unknown": 0}
    try:
        js = client.jetstream()
        subscription = await js.pull_subscribe(
            args.subject or "",
            durable=args.durable,
            stream=args.stream,
            config=nats.js.api.ConsumerConfig(ack_wait=60, max_deliver=10),
        )
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(SCHEMA)
            while True:
                try:
                    messages = await subscription.fetch(args.batch, timeout=args.idle_s)
                except TimeoutError:  # nats-py raises its own and asyncio's, both TimeoutError
                    if args.once:
                        return counts
                    continue
                for message in messages:
                    outcome = handle(conn, message.data)
                    counts[outcome] += 1
                    if outcome == "unknown":
                        await message.term()  # no worker here runs it: never redeliver
                    else:
                        await message.ack()  # after the commit: a crash before it redelivers
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--stream", required=True)
    parser.add_argument("--durable", default="workers")
    parser.add_argument("--subject", help="only the subjects matching this filter (e.g. jobs.email)")
    parser.add_argument("--dsn", default=os.environ.get("DATABASE_URL", "postgresql:///app"))
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--once", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    counts = asyncio.run(consume(args))
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
