"""``allowed_jobs`` is a real boundary (issue 22): a row never reaches a callable that the allowed
module merely imports, under any documented configuration, with real workers.

``tests.support.hostile_tasks`` defines ``greet`` and imports ``subprocess.check_output`` (and
``tests.support.tasks.record``). A row naming ``tests.support.hostile_tasks.check_output`` with
``["sh", "-c", "touch MARKER"]`` is a shell on an RQ worker if anything lets it through; each
test stages it between good rows and checks that the marker file never appears:

- RQ, exact names written by ``drain allowed-jobs`` (the default) and a plain ``rq worker``: the
  imported names are not in the list; their rows are dead-lettered with the reason.
- RQ, a wildcard: refused at start, in one line saying what to do.
- RQ, a wildcard with ``wildcards_with_checked_workers = true`` and ``rq worker --job-class
  drain_adapters.rq.job.CheckedJob`` (forking workers, as in production): the drain forwards the
  rows, the worker refuses them before the call and keeps them failed with the reason.
- Celery, with a wildcard: the worker runs registered tasks only, so the name is refused there.
"""

from __future__ import annotations

import tomllib
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
import redis
from rq import registry

import drain
from tests.support import celery_rig, configs, ledger, processes, rabbit
from tests.support.waiting import wait_until

MODULE = "tests.support.hostile_tasks"
GOOD = f"{MODULE}.greet"
SHELL = f"{MODULE}.check_output"  # subprocess.check_output, imported by the module
IMPORTED = f"{MODULE}.record"  # tests.support.tasks.record, imported by the module
GOOD_ROWS = 3


def stage(dsn: str, queue: str, marker: Path, good: str = GOOD) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
    """The two hostile rows between good ones: (good ids, hostile ids)."""
    shell = ["sh", "-c", f"touch {marker}"]
    with psycopg.connect(dsn) as conn:
        first = drain.stage(conn, good, args=[0], queue=queue)
        hostile = [
            drain.stage(conn, SHELL, args=[shell], queue=queue),
            drain.stage(conn, IMPORTED, args=[shell], queue=queue),
        ]
        rest = drain.stage_many(conn, [drain.Job(good, args=[n], queue=queue) for n in range(1, GOOD_ROWS)])
    return [first, *rest], hostile


def delivered(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        return {str(row[0]) for row in conn.execute("SELECT job_id FROM deliveries")}


def dead_letters(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn) as conn:
        return {str(row[0]): row[1] for row in conn.execute("SELECT job_id, error FROM staged_jobs_dead")}


def run_until(
    config: Path, dsn: str, log: Path, done: Any, what: str, workers: Sequence[processes.Process]
) -> str:
    the_drain = processes.start_drain(config, dsn, log)
    with processes.running(the_drain):
        wait_until(what, done, 60)
        assert the_drain.alive(), the_drain.output()
    assert all(worker.alive() for worker in workers)
    return the_drain.output()


def test_exact_names_from_drain_allowed_jobs_never_reach_what_the_module_imports(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    listed = processes.drain_cli("allowed-jobs", MODULE, dsn=database)
    assert listed.returncode == 0, listed.stderr
    allowed = tomllib.loads(listed.stdout)["allowed_jobs"]
    assert allowed == [GOOD], "what the module imports is left out"

    ledger.install(database)
    queue = f"exact-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "pwned"
    good, hostile = stage(database, queue, marker)
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rq(redis_db, allowed, max_attempts=1)}
    )
    workers = processes.start_workers(redis_db, queue, database, tmp_path, count=1)
    with processes.running(*workers):
        run_until(
            config,
            database,
            tmp_path / "drain.log",
            lambda: delivered(database) >= set(map(str, good)) and len(dead_letters(database)) == 2,
            "the good rows run and the hostile ones dead-lettered",
            workers,
        )
    dead = dead_letters(database)
    assert set(dead) == set(map(str, hostile))
    assert all("not in allowed_jobs" in error for error in dead.values()), dead
    assert delivered(database) == set(map(str, good))
    assert not marker.exists(), "a row ran a shell on the RQ worker"


def test_a_wildcard_is_refused_at_start_in_one_line(database: str, redis_db: str, tmp_path: Path) -> None:
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rq(redis_db, [f"{MODULE}.*"])}
    )
    done = processes.drain_cli("run", "--once", "--config", str(config), dsn=database)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert "a wildcard admits whatever the module imports" in line
    assert f"drain allowed-jobs {MODULE}" in line


def test_wildcards_with_checked_workers_refuse_imported_callables_on_the_worker(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    ledger.install(database)
    queue = f"checked-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "pwned"
    good, hostile = stage(database, queue, marker)
    backend = configs.rq(redis_db, [f"{MODULE}.*"], wildcards_with_checked_workers=True)
    config = configs.write_config(tmp_path / "drain.toml", database, {"default": backend})
    workers = processes.start_workers(
        redis_db,
        queue,
        database,
        tmp_path,
        count=1,
        worker_class="rq.worker.Worker",  # forks a work horse per job, as RQ does by default
        args=["--job-class", "drain_adapters.rq.job.CheckedJob"],
    )
    client = redis.Redis.from_url(redis_db)
    failed = registry.FailedJobRegistry(queue, connection=client)
    finished = registry.FinishedJobRegistry(queue, connection=client)
    with processes.running(*workers):
        log = run_until(
            config,
            database,
            tmp_path / "drain.log",
            lambda: len(failed.get_job_ids()) + len(finished.get_job_ids()) == len(good) + len(hostile),
            "every job run or failed on the worker",
            workers,
        )
    assert "CheckedJob" in log, "the drain warns that wildcards rely on the workers"
    assert not marker.exists(), "a row ran a shell on the RQ worker"
    assert set(failed.get_job_ids()) == set(map(str, hostile))
    for job_id in failed.get_job_ids():
        job = failed.job_class.fetch(job_id, connection=client)
        result = job.latest_result()
        assert result is not None and "NotDefinedHere" in (result.exc_string or ""), result
        assert "does not define" in (result.exc_string or "")
    assert delivered(database) == set(map(str, good))
    assert not marker.exists(), "a row ran a shell on the RQ worker"
    client.close()


def test_celery_runs_registered_tasks_only_whatever_allowed_jobs_admits(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    ledger.install(database)
    queue = rabbit.unique_name("celery-allowed")
    marker = tmp_path / "pwned"
    worker = celery_rig.start_worker(redis_db, queue, database, tmp_path / "worker.log", app=MODULE)
    try:
        with processes.running(worker):
            celery_rig.wait_ready(worker)
            good, hostile = stage(database, queue, marker, good="tests.support.tasks.record")
            config = celery_rig.write_config(
                tmp_path / "drain.toml", database, redis_db, allowed_jobs=["tests.support.**"]
            )

            def refused() -> bool:
                log = worker.output()
                names = (f"Received unregistered task of type '{name}'" for name in (SHELL, IMPORTED))
                return all(line in log for line in names) and all(str(job_id) in log for job_id in hostile)

            run_until(
                config,
                database,
                tmp_path / "drain.log",
                lambda: delivered(database) >= set(map(str, good)) and refused(),
                "the registered task to run and the worker to refuse the others",
                [worker],
            )
    finally:
        celery_rig.forget_queue(redis_db, queue)
    assert delivered(database) == set(map(str, good))
    assert not marker.exists(), "a row ran a shell on the Celery worker"
