"""The Celery backend end to end: ``drain run`` and a real, unmodified ``celery worker``, on
RabbitMQ and on Redis as Celery's broker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import drain
from tests.support import celery_rig, ledger, processes, rabbit
from tests.support.load import Load
from tests.support.waiting import wait_until


@pytest.fixture(params=["rabbitmq", "redis"])
def broker_url(request: pytest.FixtureRequest) -> str:
    if request.param == "rabbitmq":
        rabbit.need_rabbitmq()
        return rabbit.SHARED_URL
    url: str = request.getfixturevalue("redis_db")
    return url


@pytest.fixture
def queue(broker_url: str) -> Iterator[str]:
    name = rabbit.unique_name("celery")
    yield name
    celery_rig.forget_queue(broker_url, name)


@pytest.fixture
def worker(broker_url: str, queue: str, database: str, tmp_path: Path) -> Iterator[processes.Process]:
    ledger.install(database)
    started = celery_rig.start_worker(broker_url, queue, database, tmp_path / "worker.log")
    with processes.running(started):
        celery_rig.wait_ready(started)
        yield started


def test_committed_tasks_run_with_the_staged_id_rolled_back_never(
    broker_url: str, queue: str, worker: processes.Process, database: str, tmp_path: Path
) -> None:
    config = celery_rig.write_config(tmp_path / "drain.toml", database, broker_url)
    drain_process = processes.start_drain(config, database, tmp_path / "drain.log")
    with processes.running(drain_process):
        result = Load(database, 5_000, threads=4, queue=queue).start().join()
        tally = ledger.wait_drained(database, len(result.committed), timeout_s=150)
        assert drain_process.alive(), drain_process.output()[-3000:]
    print(f"\n{result.transactions} transactions: {tally}")

    assert len(tally.committed) == len(result.committed) > 2_500
    assert len(result.rolled_back) > 1_000
    # deliveries.job_id is the task id the worker saw; lost counts ledger ids with no such run
    assert not tally.lost, "G1/G4: a committed job never ran under its staged id"
    assert not tally.phantom, "G2: a task ran that no committed transaction staged"
    assert tally.early == 0, "G3: a task ran before its transaction committed"
    with psycopg.connect(database) as conn:
        ran = {row[0] for row in conn.execute("SELECT job_id FROM deliveries")}
        names = {row[0] for row in conn.execute("SELECT DISTINCT job_name FROM deliveries")}
    assert not ran & result.rolled_back
    assert names == {"tests.support.tasks.record"}


def test_unknown_tasks_travel_and_tasks_outside_allowed_jobs_never_do(
    broker_url: str, queue: str, worker: processes.Process, database: str, tmp_path: Path
) -> None:
    """A task name no worker registered reaches the worker, which refuses it the Celery way; a
    name outside ``allowed_jobs`` never leaves the database (dead-lettered with the reason)."""
    config = celery_rig.write_config(
        tmp_path / "drain.toml", database, broker_url, backend={"max_attempts": 1}
    )
    with psycopg.connect(database) as conn:
        unknown = drain.stage(conn, "tests.celery.nobody_knows", args=[1], queue=queue)
        outside = drain.stage(conn, "app.admin.drop_everything", queue=queue)
        known = drain.stage(conn, "tests.support.tasks.record", args=[2], queue=queue)
    done = processes.drain_cli("run", "--once", "--config", str(config), dsn=database)
    assert done.returncode == 0, done.stderr

    def refused_by_the_worker() -> bool:
        log = worker.output()
        return "Received unregistered task of type 'tests.celery.nobody_knows'" in log and str(unknown) in log

    wait_until("the worker to refuse the unknown task", refused_by_the_worker, 30)
    wait_until("the known task to run", lambda: len(ledger.tally(database).delivered) == 1, 30)
    with psycopg.connect(database) as conn:
        ran = [row[0] for row in conn.execute("SELECT job_id FROM deliveries")]
        (left,) = conn.execute("SELECT count(*) FROM staged_jobs").fetchone() or (0,)
        dead = conn.execute("SELECT job_id, error FROM staged_jobs_dead").fetchall()
    assert ran == [known]
    assert left == 0, "the unknown task was forwarded, not kept"
    assert [row[0] for row in dead] == [outside]
    assert "allowed_jobs" in dead[0][1]
    assert "app.admin.drop_everything" not in worker.output()
    assert worker.alive()


def test_on_rabbitmq_tasks_staged_before_any_worker_declared_their_queue_wait_in_it(
    database: str, tmp_path: Path
) -> None:
    """Celery on AMQP before the first worker started: as ``send_task`` would, the drain declares
    the queue (Celery's default queue, exchange and binding) before publishing to it, so the
    tasks wait there and the worker started later runs them all; nothing is dead-lettered."""
    rabbit.need_rabbitmq()
    broker_url = rabbit.SHARED_URL
    queue = rabbit.unique_name("celery-first")
    ledger.install(database)
    config = celery_rig.write_config(
        tmp_path / "drain.toml", database, broker_url, backend={"max_attempts": 1}
    )
    try:
        drain_process = processes.start_drain(config, database, tmp_path / "drain.log")
        with processes.running(drain_process):
            result = Load(database, 60, threads=2, queue=queue).start().join()
            wait_until("the tasks to be forwarded", lambda: rabbit.staged_count(database) == 0, 60)
            assert ledger.tally(database).dead == set(), "tasks were dead-lettered: no queue yet"
            worker = celery_rig.start_worker(broker_url, queue, database, tmp_path / "worker.log")
            with processes.running(worker):
                celery_rig.wait_ready(worker)
                tally = ledger.wait_drained(database, len(result.committed), timeout_s=120)
            assert drain_process.alive(), drain_process.output()[-3000:]
    finally:
        celery_rig.forget_queue(broker_url, queue)
    print(f"\n{tally}")
    assert not tally.dead
    tally.check()
