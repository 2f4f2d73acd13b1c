"""A job's ordering key reaches a real ``celery worker`` as the message header ``x-ordering-key``
(``self.request.get("x-ordering-key")`` in the task), on RabbitMQ and on Redis as Celery's
broker; one worker with the solo pool (one task at a time) runs each key's jobs in staging order,
though the drain refuses the first attempt of every fifth row (the ``refuse_first`` failpoint).
A job without a key carries no such header."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import celery_rig, celery_tasks, ledger, ordering, processes, rabbit
from tests.support.waiting import wait_until

JOBS = 300


@pytest.fixture(params=["rabbitmq", "redis"])
def broker_url(request: pytest.FixtureRequest) -> str:
    if request.param == "rabbitmq":
        rabbit.need_rabbitmq()
        return rabbit.SHARED_URL
    url: str = request.getfixturevalue("redis_db")
    return url


@pytest.fixture
def queue(broker_url: str) -> Iterator[str]:
    name = rabbit.unique_name("celery-keyed")
    yield name
    celery_rig.forget_queue(broker_url, name)


def test_one_solo_worker_gets_each_key_in_staging_order_with_its_header(
    broker_url: str, queue: str, database: str, tmp_path: Path
) -> None:
    ledger.install(database)
    ordering.install(database)
    config = celery_rig.write_config(tmp_path / "drain.toml", database, broker_url, retry_base_s=0.3)
    worker = celery_rig.start_worker(broker_url, queue, database, tmp_path / "worker.log")
    with processes.running(worker):
        celery_rig.wait_ready(worker)
        result = (
            ordering.KeyedLoad(
                database,
                JOBS,
                queue=queue,
                job=celery_tasks.KEYED_TASK,
                keys=ordering.KEYS[:10],
                unkeyed_fraction=0.1,
            )
            .start()
            .join()
        )
        drain_process = processes.start_drain(
            config, database, tmp_path / "drain.log", failpoints=ordering.FAILPOINT
        )
        with processes.running(drain_process):

            def ran() -> bool:
                assert worker.alive(), worker.output()[-3000:]
                return {job_id for job_id, _ in ordering.recorded(database)} >= result.committed.keys()

            wait_until("every committed task to run", ran, 120)
    deliveries = ordering.recorded(database)
    report = ordering.check_order(result.committed, {queue: deliveries})
    print(f"\norder: {report}")
    report.check()  # each key in order, each task handed its key (None without one)
    assert report.keys == 10
    assert any(key is None for _row, key in result.committed.values())
    refusable = {row_id for row_id, _key in result.committed.values() if row_id % ordering.REFUSE_EVERY == 0}
    assert refusable and refusable <= ordering.refused_rows([tmp_path / "drain.log"])
    ledger.tally(database, ordering.counted(deliveries), result.rolled_back).check()
