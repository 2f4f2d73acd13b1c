"""Red team (G1 through NATS JetStream and Dramatiq on Redis): a job id used again is lost.

docs/staging.md promises: "The id is unique **while staged**: once the drain has forwarded or
dead-lettered the row, the same id stages a new job" (an app's own ``job_id`` as an idempotency
key, e.g. ``uuid5(order, "receipt")`` staged again for the next receipt). The two new backends
de-duplicate by job id beyond that:

- NATS: ``Nats-Msg-Id`` = job id, so the new job, published within the stream's duplicate
  window (2 minutes by default) of the old one, is answered "duplicate": the adapter calls it
  PUBLISHED, the drain deletes the row, the stream never stores it.
- Dramatiq on Redis: ``redis_message_id`` = job id and the script skips an id the queue's hash
  holds (the old message, still queued or running): reply SKIPPED, the row deleted, nothing
  written.

Either way a committed job is deleted from the table, never dead-lettered, and never reaches its
backend: lost, with no log line. Expected: the new job delivered (or, if the backends cannot,
stage() refusing the id while the backend may still remember it, and the docs saying so).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg
import redis

import drain
from tests.support import configs, jetstream, processes

ACTOR = "app.tasks.record"
QUEUE = f"receipts-{uuid.uuid4().hex[:8]}"  # a queue of this test's own in the shared Redis


def stage(dsn: str, job_id: uuid.UUID, marker: str) -> None:
    with psycopg.connect(dsn) as conn:
        drain.stage(conn, ACTOR, args=[marker], queue=QUEUE, backend="b", job_id=job_id)


def drain_once(config: Path, log: Path) -> None:
    finished = processes.start_drain(config, None, log, "--once")
    assert finished.wait(60) == 0, finished.output()


def left(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
        dead = conn.execute("SELECT count(*) FROM staged_jobs_dead").fetchone()
    return int(row[0] if row else 0) + int(dead[0] if dead else 0)


def test_nats_a_new_job_under_a_forwarded_id_is_delivered(database: str, tmp_path: Path) -> None:
    jetstream.need_nats()
    stream = jetstream.unique_name("RTREUSE")
    section = {"type": "nats", "url": jetstream.SHARED_URL, "subject_prefix": stream, "queues": [QUEUE]}
    config = configs.write_config(tmp_path / "drain.toml", database, {"b": section})
    job_id = uuid.uuid4()
    with jetstream.stream(stream, [f"{stream}.*"]):
        stage(database, job_id, "first receipt")
        drain_once(config, tmp_path / "first.log")
        stage(database, job_id, "second receipt")  # allowed: the id is no longer staged
        drain_once(config, tmp_path / "second.log")
        bodies = [json.loads(message.data)["args"][0] for message in jetstream.messages(stream)]
    assert left(database) == 0  # the second row is gone from the table, not dead-lettered
    assert bodies == ["first receipt", "second receipt"], bodies


def test_dramatiq_redis_a_new_job_under_a_forwarded_id_is_delivered(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    section = {"type": "dramatiq", "url": redis_db, "allowed_actors": [ACTOR]}
    config = configs.write_config(tmp_path / "drain.toml", database, {"b": section})
    job_id = uuid.uuid4()
    stage(database, job_id, "first receipt")
    drain_once(config, tmp_path / "first.log")
    stage(database, job_id, "second receipt")
    drain_once(config, tmp_path / "second.log")
    client = redis.Redis.from_url(redis_db)
    try:
        queued = client.lrange(f"dramatiq:{QUEUE}", 0, -1)
        bodies = [
            json.loads(client.hget(f"dramatiq:{QUEUE}.msgs", item) or b"{}")["args"][0] for item in queued
        ]
    finally:
        client.close()
    assert left(database) == 0
    assert bodies == ["first receipt", "second receipt"], bodies
