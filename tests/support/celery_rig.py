"""Real ``celery worker`` processes and drain configs with a Celery backend, for the Celery tests.

A worker runs ``tests.support.celery_tasks`` with the solo pool (one task at a time: gentle on a
shared machine) on a queue of the test's own, with remote control, gossip, mingle and heartbeats
off so it leaves nothing behind on the shared broker but its queue (and, on RabbitMQ, the
exchange named after it), which ``forget_queue`` deletes.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import redis

from tests.support import celery_tasks, configs, processes, rabbit
from tests.support.waiting import wait_until

CELERY = str(processes.BIN / "celery")
READY_TIMEOUT_S = 60.0
ALLOWED_JOBS = ("tests.support.tasks.record", "tests.celery.*")


def write_config(
    path: Path,
    dsn: str,
    broker_url: str,
    *,
    allowed_jobs: Sequence[str] = ALLOWED_JOBS,
    backend: Mapping[str, Any] | None = None,
    **settings: Any,
) -> Path:
    """A drain.toml whose default backend is Celery on ``broker_url`` (``backend``: more keys of
    that section), through the one config writer."""
    section = {
        "type": "celery",
        "broker_url": broker_url,
        "allowed_jobs": list(allowed_jobs),
        **(backend or {}),
    }
    return configs.write_config(path, dsn, {"default": section}, **settings)


def start_worker(
    broker_url: str,
    queue: str,
    dsn: str,
    log: Path,
    *,
    pool: str = "solo",
    app: str = "tests.support.celery_tasks",
    transport_options: Mapping[str, Any] | None = None,
) -> processes.Process:
    """One ``celery worker`` of ``app`` consuming ``queue`` (``transport_options``: Celery's
    ``broker_transport_options``); ``wait_ready`` tells when it consumes."""
    return processes.Process(
        [
            CELERY,
            "-A",
            app,
            "worker",
            "--pool",
            pool,
            "--concurrency",
            "1",
            "--queues",
            queue,
            "--hostname",
            f"{queue}@drain-test",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        processes.environment(
            dsn,
            {
                celery_tasks.BROKER_VARIABLE: broker_url,
                celery_tasks.TRANSPORT_VARIABLE: json.dumps(transport_options or {}),
            },
        ),
        log,
    )


def wait_ready(worker: processes.Process) -> None:
    def ready() -> bool:
        assert worker.alive(), worker.output()[-3000:]
        return re.search(r"@drain-test ready\.", worker.output()) is not None

    wait_until("the celery worker to be ready", ready, READY_TIMEOUT_S)


def forget_queue(broker_url: str, queue: str) -> None:
    """Delete what the worker declared for ``queue`` (only that)."""
    if broker_url.startswith("redis"):
        client = redis.Redis.from_url(broker_url)
        try:
            client.delete(queue, *(f"{queue}\x06\x16{step}" for step in (3, 6, 9)))
            client.srem(f"_kombu.binding.{queue}", *client.smembers(f"_kombu.binding.{queue}") or [b""])
        finally:
            client.close()
        return
    # Celery spells the default vhost "//", pika "/%2F"
    url = broker_url[:-2] + "/%2F" if broker_url.endswith("//") else broker_url
    with contextlib.suppress(Exception):
        rabbit.delete_queues(url, queue)
    with contextlib.suppress(Exception):
        rabbit.delete_exchange(url, queue)
