"""The Celery app a real ``celery worker`` runs in the tests (``celery -A tests.support.celery_tasks``).

Its task ``record`` is registered under the name the load stages (``tests.support.load.JOB_NAME``)
and records each run in the ``deliveries`` table, with the task id the worker sees as ``job_id``;
``keyed`` records each run in ``keyed_deliveries`` (tests.support.ordering) with the ordering key
its message headers carried. The
broker URL comes through ``DRAIN_TEST_CELERY_BROKER`` and the database through
``DRAIN_TEST_DELIVERIES_DSN`` (read when the worker imports this module: it is a test fixture).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import celery
import psycopg

from drain import models
from tests.support import load, tasks

BROKER_VARIABLE = "DRAIN_TEST_CELERY_BROKER"
TRANSPORT_VARIABLE = "DRAIN_TEST_CELERY_TRANSPORT"
KEYED_TASK = "tests.celery.keyed"

app = celery.Celery("drain_tests", broker=os.environ.get(BROKER_VARIABLE, "memory://"), set_as_current=False)
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    worker_enable_remote_control=False,  # no pidbox queues left behind on the shared broker
    worker_send_task_events=False,
    worker_prefetch_multiplier=50,
    broker_connection_retry_on_startup=True,
    task_acks_late=True,  # a worker killed mid-task leaves the message to be redelivered
    broker_transport_options=json.loads(os.environ.get(TRANSPORT_VARIABLE) or "{}"),
)

_local = threading.local()


def _connection() -> psycopg.Connection[Any]:
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = _local.conn = psycopg.connect(os.environ[tasks.DSN_VARIABLE], autocommit=True)
    return conn


@app.task(name=load.JOB_NAME, bind=True)
def record(self: Any, *args: Any, **kwargs: Any) -> str:
    """Record this run: the task id Celery gave the worker, the name, the arguments, the pid."""
    task_id: str = self.request.id
    _connection().execute(
        "INSERT INTO deliveries (job_id, job_name, args, kwargs, worker) VALUES (%s, %s, %s, %s, %s)",
        (task_id, self.name, json.dumps(args), json.dumps(kwargs), os.getpid()),
    )
    return task_id


@app.task(name=KEYED_TASK, bind=True)
def keyed(self: Any, *_args: Any, **_kwargs: Any) -> str:
    """Record this run with the ordering key the message's headers carried (None: none)."""
    task_id: str = self.request.id
    _connection().execute(
        "INSERT INTO keyed_deliveries (job_id, ordering_key) VALUES (%s, %s)",
        (task_id, self.request.get(models.ORDERING_KEY_HEADER)),
    )
    return task_id
