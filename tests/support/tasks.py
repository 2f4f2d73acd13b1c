"""The functions a real ``rq worker`` runs in the integration tests.

Each run is recorded as one row of the ``deliveries`` table of the test's database (its DSN comes
through ``DRAIN_TEST_DELIVERIES_DSN``): RQ's job id, the function name, the arguments and the
database clock at the moment the job ran. Duplicates are kept, so a test can count them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import psycopg
import rq

DSN_VARIABLE = "DRAIN_TEST_DELIVERIES_DSN"

_sessions: dict[str, psycopg.Connection[Any]] = {}


def _connection() -> psycopg.Connection[Any]:
    """One session per worker process (a SimpleWorker runs every job in its own process)."""
    conn = _sessions.get("deliveries")
    if conn is None or conn.closed:
        conn = _sessions["deliveries"] = psycopg.connect(os.environ[DSN_VARIABLE], autocommit=True)
    return conn


def record(*args: Any, **kwargs: Any) -> str:
    """Record this delivery; return the job id."""
    job = rq.get_current_job()
    assert job is not None
    _connection().execute(
        "INSERT INTO deliveries (job_id, job_name, args, kwargs, worker) VALUES (%s, %s, %s, %s, %s)",
        (job.id, job.func_name, json.dumps(args), json.dumps(kwargs), os.getpid()),
    )
    return job.id
