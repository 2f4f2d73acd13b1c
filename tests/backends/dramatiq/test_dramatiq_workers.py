"""G1, G2 and G4 for the Dramatiq backend with a real, unmodified ``dramatiq`` worker on each
broker: jobs staged under load (a third of the transactions rolled back), the drain SIGKILLed
mid-run and started again. Every committed job runs (lost = 0), none rolled back does, and each
run's Dramatiq message id is its job id (a run under any other id would count as a phantom)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support import configs, dramatiq_tasks, ledger, processes, rabbit
from tests.support.load import Load
from tests.support.waiting import wait_until

READY_TIMEOUT_S = 60.0
DRAINED_TIMEOUT_S = 120.0


def start_worker(url: str, queue: str, dsn: str, log: Path) -> processes.Process:
    """``dramatiq tests.support.dramatiq_tasks`` on ``queue``: one process, two threads."""
    env = {dramatiq_tasks.URL_VARIABLE: url, dramatiq_tasks.QUEUE_VARIABLE: queue}
    return processes.Process(
        [
            str(processes.BIN / "dramatiq"),
            "tests.support.dramatiq_tasks",
            "--processes",
            "1",
            "--threads",
            "2",
            "--queues",
            queue,
        ],
        processes.environment(dsn, env),
        log,
    )


def wait_ready(worker: processes.Process) -> None:
    wait_until(
        "the dramatiq worker to consume",
        lambda: "ready for action" in worker.output() or not worker.alive(),
        READY_TIMEOUT_S,
    )
    assert worker.alive(), worker.output()[-3000:]


def forget(url: str, queue: str) -> None:
    """Delete what the test made on the shared broker (a Redis db index is the fixture's)."""
    if url.startswith("amqp"):
        with contextlib.suppress(Exception):
            rabbit.delete_queues(url, queue, f"{queue}.DQ", f"{queue}.XQ")


@contextlib.contextmanager
def rig(url: str, database: str, tmp_path: Path) -> Iterator[tuple[str, Path, processes.Process]]:
    """A worker on a queue of its own and a drain config for ``url``; yields (queue, config, worker)."""
    ledger.install(database)
    queue = rabbit.unique_name("dramatiq").replace("-", "_")
    worker = start_worker(url, queue, database, tmp_path / "worker.log")
    try:
        with processes.running(worker):
            wait_ready(worker)
            section = {
                "type": "dramatiq",
                "url": url,
                "allowed_actors": [dramatiq_tasks.ACTOR],
                "publish_timeout_s": 5.0,
            }
            config = configs.write_config(
                tmp_path / "drain.toml", database, {"default": section}, batch_size=100
            )
            yield queue, config, worker
    finally:
        forget(url, queue)


def delivered(database: str) -> int:
    return len(ledger.tally(database).delivered)


@pytest.mark.parametrize("broker", ["rabbitmq", "redis"])
def test_drain_sigkilled_mid_run_loses_nothing_and_ids_are_job_ids(
    broker: str, database: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if broker == "rabbitmq":
        rabbit.need_rabbitmq()
        url = rabbit.SHARED_URL
    else:
        url = request.getfixturevalue("redis_db")
    with rig(url, database, tmp_path) as (queue, config, worker):
        first = processes.start_drain(config, database, tmp_path / "drain-1.log")
        # Staging goes on until it is stopped, so the kill always falls in the middle of the run.
        load = Load(database, None, threads=2, queue=queue, job=dramatiq_tasks.ACTOR, pace_s=(0.01, 0.03))
        try:
            with processes.running(first):
                load.start()
                wait_until("jobs to run before the kill", lambda: delivered(database) >= 50, 60)
                first.kill()  # SIGKILL: no shutdown, a batch may be mid-flight
                at_kill = ledger.tally(database)
            wait_until(
                "jobs committed while no drain runs",
                lambda: len(ledger.tally(database).committed) >= len(at_kill.committed) + 50,
                60,
            )
            second = processes.start_drain(config, database, tmp_path / "drain-2.log")
            with processes.running(second):
                wait_until(
                    "the new drain to forward", lambda: delivered(database) > len(at_kill.delivered), 60
                )
                result = load.stop()
                tally = ledger.wait_drained(database, len(result.committed), timeout_s=DRAINED_TIMEOUT_S)
        finally:
            load.stop()
        assert worker.alive(), worker.output()[-3000:]
    print(f"\n{tally}")
    assert tally is not None
    assert len(tally.committed) == len(result.committed) >= len(at_kill.committed) + 50
    tally.rolled_back = set(result.rolled_back)
    tally.check()  # lost 0, no phantom (a run under an id other than a job id), no rolled-back run
    if broker == "redis":  # the worker acked every message: nothing left in the queue's hash
        client = redis.Redis.from_url(url)
        try:
            wait_until("the worker to ack", lambda: client.hlen(f"dramatiq:{queue}.msgs") == 0, 30)
        finally:
            client.close()
