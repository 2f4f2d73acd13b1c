"""G1 for the Celery backend with real ``celery worker``s: the broker SIGKILLed and restarted mid-run
(a private Redis with fsync-always AOF, a private RabbitMQ node), and the drain SIGKILLed mid-run.
Every committed task runs (lost = 0); duplicates are allowed (at least once)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import celery_rig, ledger, processes, rabbit, redis_server
from tests.support.load import Load, LoadResult
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

JOBS = 2_000
DRAINED_TIMEOUT_S = 300.0  # a deadline: one solo worker on a machine others load heavily


@contextlib.contextmanager
def private_redis(base: Path) -> Iterator[redis_server.RedisServer]:
    base.mkdir()
    server = redis_server.RedisServer(base)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def rig(broker_url: str, database: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A worker on a queue of its own and a drain config for ``broker_url``; yields (queue, config)."""
    ledger.install(database)
    queue = rabbit.unique_name("celery-fault")
    worker = celery_rig.start_worker(broker_url, queue, database, tmp_path / "worker.log")
    try:
        with processes.running(worker):
            celery_rig.wait_ready(worker)
            config = celery_rig.write_config(
                tmp_path / "drain.toml",
                database,
                broker_url,
                batch_size=200,
                publish_timeout_s=5.0,
                backend={"connect_timeout_s": 2.0},
            )
            yield queue, config
    finally:
        with contextlib.suppress(Exception):
            celery_rig.forget_queue(broker_url, queue)


def delivered(database: str) -> int:
    return len(ledger.tally(database).delivered)


def forwarded(database: str) -> int:
    """Committed rows no longer staged: forwarded (or dead-lettered) by the drain."""
    now = ledger.tally(database)
    return len(now.committed) - now.remaining


def check(result: LoadResult, tally: ledger.Tally) -> None:
    print(f"\n{tally}")
    assert len(tally.committed) == len(result.committed) > JOBS // 3
    assert not tally.lost, "G1: a committed task never ran"
    assert not tally.phantom, "G2: a task ran that no committed transaction staged"
    assert tally.early == 0


def broker_killed_mid_run(
    broker_url: str, kill: object, start: object, database: str, tmp_path: Path
) -> tuple[LoadResult, ledger.Tally, str]:
    with rig(broker_url, database, tmp_path) as (queue, config):
        drain = processes.start_drain(config, database, tmp_path / "drain.log")
        with processes.running(drain):
            load = Load(database, JOBS, threads=2, queue=queue, pace_s=(0, 0.004)).start()
            wait_until("tasks to run before the kill", lambda: delivered(database) >= 200, 60)
            kill()  # type: ignore[operator]
            at_kill = ledger.tally(database)
            wait_until("the drain to see the broker down", lambda: "unavailable" in drain.output(), 60)
            start()  # type: ignore[operator]
            result = load.join()
            tally = ledger.wait_drained(database, len(result.committed), timeout_s=DRAINED_TIMEOUT_S)
            assert drain.alive(), drain.output()[-3000:]
            assert len(at_kill.committed) < len(tally.committed), (
                "the broker died after the run, not during it"
            )
            return result, tally, drain.output()


def test_redis_broker_sigkilled_and_restarted_mid_run(database: str, tmp_path: Path) -> None:
    """kombu's Redis consumer pops a message (BRPOP) before it records it as unacknowledged, so a
    broker killed in between loses that one message on the *worker's* side, whatever published
    it. To test what the drain guarantees, the worker is stopped (gracefully: it puts back what it
    held) before the broker is killed, and a fresh one runs the rest after the restart."""
    with private_redis(tmp_path / "redis") as server:
        ledger.install(database)
        queue = rabbit.unique_name("celery-fault")
        config = celery_rig.write_config(
            tmp_path / "drain.toml",
            database,
            server.url,
            batch_size=200,
            publish_timeout_s=5.0,
            backend={"connect_timeout_s": 2.0},
        )
        first = celery_rig.start_worker(server.url, queue, database, tmp_path / "worker-1.log")
        drain = processes.start_drain(config, database, tmp_path / "drain.log")
        with processes.running(drain):
            with processes.running(first):
                celery_rig.wait_ready(first)
                load = Load(database, JOBS, threads=2, queue=queue, pace_s=(0, 0.004)).start()
                wait_until("tasks to run before the kill", lambda: delivered(database) >= 200, 60)
            server.kill()
            at_kill = ledger.tally(database)
            # Something to publish while the broker is down, however far the load got (on a
            # loaded machine it can finish before the slow worker ran 200 tasks).
            nudge = Load(database, 5, threads=1, queue=queue, rollback_fraction=0.0).start()
            wait_until("the drain to see the broker down", lambda: "unavailable" in drain.output(), 60)
            server.start()
            second = celery_rig.start_worker(server.url, queue, database, tmp_path / "worker-2.log")
            with processes.running(second):
                result = load.join()
                result.committed |= nudge.join().committed
                tally = ledger.wait_drained(database, len(result.committed), timeout_s=DRAINED_TIMEOUT_S)
            assert drain.alive(), drain.output()[-3000:]
    assert len(at_kill.committed) < len(tally.committed), "the broker died after the run, not during it"
    check(result, tally)


def test_rabbitmq_broker_sigkilled_and_restarted_mid_run(database: str, tmp_path: Path) -> None:
    with rabbit.private_broker(tmp_path / "rabbit") as broker:
        url = broker.url.replace("/%2F", "//")  # Celery's spelling of the default vhost
        result, tally, _log = broker_killed_mid_run(url, broker.kill, broker.start, database, tmp_path)
    check(result, tally)


@pytest.mark.parametrize("broker", ["rabbitmq", "redis"])
def test_drain_sigkilled_mid_run_loses_nothing(
    broker: str, database: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if broker == "rabbitmq":
        rabbit.need_rabbitmq()
        url = rabbit.SHARED_URL
    else:
        url = request.getfixturevalue("redis_db")
    with rig(url, database, tmp_path) as (queue, config):
        first = processes.start_drain(config, database, tmp_path / "drain-1.log")
        with processes.running(first):
            # Paced to last several seconds, and the kill timed by what the drain forwarded
            # (rows gone from the table), not by what the worker ran: a worker slow to start
            # once ran its 300th task after the whole load had been forwarded.
            load = Load(database, JOBS, threads=2, queue=queue, pace_s=(0.002, 0.01)).start()
            wait_until("rows forwarded before the kill", lambda: forwarded(database) >= 300, 60)
            first.kill()  # SIGKILL: no shutdown, a batch may be mid-flight
            at_kill = ledger.tally(database)
        second = processes.start_drain(config, database, tmp_path / "drain-2.log")
        with processes.running(second):
            result = load.join()
            tally = ledger.wait_drained(database, len(result.committed), timeout_s=DRAINED_TIMEOUT_S)
    check(result, tally)
    mid_run = len(at_kill.committed) < len(tally.committed) or at_kill.remaining > 0
    assert mid_run, "the drain died after the run, not during it"
