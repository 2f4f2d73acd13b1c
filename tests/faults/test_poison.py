"""Poison rows at the head of the table never block the rows behind them (G6).

Three kinds of rows that can never be delivered sit before good ones: a backend nobody configured,
a job outside RQ's ``allowed_jobs``, and RQ options of the wrong type. The good rows reach Redis as
RQ jobs (read back from Redis, each once); the poison rows are retried with backoff and, after
``max_attempts``, end in the dead-letter table with their error. Nothing else is dead-lettered.
"""

from __future__ import annotations

import dataclasses
import uuid

import psycopg
import pytest
import redis
import rq
from rq import job as rq_job

import drain
from drain import backend, config
from drain.relay import loop as relay
from tests.support.waiting import wait_until

MAX_ATTEMPTS = 3
GOOD = 20
DEADLINE_S = 90.0


def test_poison_rows_are_dead_lettered_and_never_block(
    settings: config.Settings, database: str, redis_db: str
) -> None:
    queue = f"drain-poison-{uuid.uuid4().hex[:8]}"
    settings = dataclasses.replace(
        settings,
        batch_size=5,
        max_attempts=MAX_ATTEMPTS,  # what a row for an unknown backend gets
        retry_base_s=0.01,
        retry_max_s=0.05,
        backends={
            "default": config.BackendSettings(
                "default", "rq", MAX_ATTEMPTS, {"url": redis_db, "allowed_jobs": ["app.tasks.ok"]}
            )
        },
    )
    poison = [
        drain.Job("app.tasks.ok", queue=queue, backend="nowhere"),
        drain.Job("os.system", args=["echo pwned"], queue=queue),
        drain.Job("app.tasks.ok", queue=queue, options={"timeout": "soon"}),
        drain.Job("app.tasks.ok", queue=queue, options={"retry": {"max": "three"}}),
    ]
    good = [drain.Job("app.tasks.ok", args=[n], queue=queue) for n in range(GOOD)]
    with psycopg.connect(database) as conn:
        poison_ids = drain.stage_many(conn, poison)
        good_ids = drain.stage_many(conn, good)

    the_relay = relay.Relay(settings, backend.build_adapters(settings.backends, settings.publish_timeout_s))
    try:
        assert the_relay.leadership.try_acquire()
        first = the_relay.drain_once()  # the head: four poison rows and one good one
        assert (first.selected, first.published, first.rejected, first.dead) == (5, 1, 4, 0)

        def drained() -> bool:
            if not remaining(database):
                return True
            the_relay.drain_once()  # the poison rows back off (tens of milliseconds) between turns
            return False

        wait_until("the rows to be forwarded or dead-lettered", drained, DEADLINE_S, interval_s=0.02)
    finally:
        the_relay.shutdown()

    client = redis.Redis.from_url(redis_db)
    try:
        rq_queue = rq.Queue(queue, connection=client)
        assert sorted(rq_queue.job_ids) == sorted(str(job_id) for job_id in good_ids)  # each once
        assert all(client.exists(rq_job.Job.key_for(str(job_id))) for job_id in good_ids)
        assert not any(client.exists(rq_job.Job.key_for(str(job_id))) for job_id in poison_ids)
    finally:
        client.close()

    with psycopg.connect(database) as conn:
        dead = conn.execute("SELECT job_id, attempts, error FROM staged_jobs_dead ORDER BY id").fetchall()
    assert [row[0] for row in dead] == poison_ids
    assert all(row[1] == MAX_ATTEMPTS for row in dead)
    errors_ = [row[2] for row in dead]
    assert "no backend named 'nowhere'" in errors_[0]
    assert "not in allowed_jobs" in errors_[1]
    assert "RQ option timeout must be an integer" in errors_[2]
    assert "RQ option retry must be" in errors_[3]


def remaining(database: str) -> int:
    with psycopg.connect(database) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture(autouse=True)
def _quiet_rq_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="drain_adapters.rq")
