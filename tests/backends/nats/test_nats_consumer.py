"""examples/nats_consumer.py, run as a process against jobs the drain's NATS backend published:
it runs each job once, acks every message, and turns a re-publish after the duplicate window
(stored again by JetStream, same job id) into a no-op; a job no task of its handles is
terminated, not redelivered."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time

import nats
import psycopg
import pytest
from drain_adapters import nats as nats_backend

from drain import models
from tests.support import jetstream, jobs, processes
from tests.support.waiting import wait_until

EXAMPLE = processes.ROOT / "examples" / "nats_consumer.py"
WINDOW_S = 1.0


@pytest.fixture(autouse=True)
def _need_nats() -> None:
    jetstream.need_nats()


def consumer_state(stream: str, durable: str) -> tuple[int, int]:
    async def run() -> tuple[int, int]:
        client = await nats.connect(jetstream.SHARED_URL)
        try:
            info = await client.jetstream().consumer_info(stream, durable)
            return info.num_pending or 0, info.num_ack_pending or 0
        finally:
            await client.close()

    return asyncio.run(run())


def test_the_example_consumer_runs_each_job_once_and_acks_everything(database: str) -> None:
    stream = jetstream.unique_name("CONSUMER")
    with jetstream.stream(stream, [f"{stream}.*"], duplicate_window=WINDOW_S):
        adapter = nats_backend.NatsAdapter.from_options(
            "test", {"url": jetstream.SHARED_URL, "subject_prefix": stream}, publish_timeout_s=10
        )
        batch = [
            dataclasses.replace(jobs.staged(n, "email", "app.tasks.send_email"), args=[f"u{n}@example.com"])
            for n in range(1, 4)
        ]
        unknown = jobs.staged(4, "email", "app.tasks.not_here")
        adapter.open()
        try:
            results = adapter.publish_batch([*batch, unknown])
            started = time.monotonic()
            wait_until("the duplicate window to pass", lambda: time.monotonic() - started > WINDOW_S * 1.5, 5)
            again = adapter.publish_batch([batch[0]])  # after the window: stored again
        finally:
            adapter.close()
        assert {result.outcome for result in [*results, *again]} == {models.Outcome.PUBLISHED}
        command = [sys.executable, str(EXAMPLE), "--url", jetstream.SHARED_URL, "--stream", stream]
        command += ["--durable", "workers", "--dsn", database, "--once", "--idle-s", "3"]
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        counts = json.loads(done.stdout.strip().splitlines()[-1])
        assert counts == {"done": 3, "duplicate": 1, "unknown": 1}, done.stderr
        assert consumer_state(stream, "workers") == (0, 0), "a message left unacknowledged"
    with psycopg.connect(database) as conn:
        processed = {row[0] for row in conn.execute("SELECT job_id FROM processed_jobs")}
    assert processed == {job.job_id for job in batch}
