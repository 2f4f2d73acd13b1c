"""Stage jobs and watch them reach RQ: the "jobs flow" check of the deployment tests."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import psycopg
import redis
from rq import Queue

import drain
from tests.support.waiting import wait_until


def stage(dsn: str, names: Sequence[str]) -> list[uuid.UUID]:
    """Stage one job per name in one committed transaction, as an app (the owner role) would."""
    with psycopg.connect(dsn) as conn:
        return [drain.stage(conn, name, args=[index]) for index, name in enumerate(names)]


def staged_left(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    assert row is not None
    return int(row[0])


def dead_letters(dsn: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT job_name, error FROM staged_jobs_dead ORDER BY id").fetchall()
    return [(str(name), str(error)) for name, error in rows]


def queued_ids(redis_url: str, queue: str = "default") -> set[str]:
    connection = redis.Redis.from_url(redis_url)
    try:
        return set(Queue(queue, connection=connection).job_ids)
    finally:
        connection.close()


def wait_forwarded(dsn: str, redis_url: str, job_ids: Sequence[uuid.UUID], timeout_s: float = 60.0) -> None:
    """Until every job id is in RQ's queue and the table is empty."""
    expected = {str(job_id) for job_id in job_ids}
    wait_until(
        f"{len(expected)} jobs forwarded to RQ and the table empty",
        lambda: expected <= queued_ids(redis_url) and staged_left(dsn) == 0,
        timeout_s,
    )
