"""Per-key order on RQ end to end (issue 25): 4 producers staging jobs of 50 keys, a real ``drain
run`` that refuses the first attempt of every fifth row (the ``refuse_first`` failpoint) and is
SIGKILLed several times, one real ``rq worker`` on the queue. Per key, the worker runs the jobs
in staging (row id) order, each handed its key in ``job.meta["ordering_key"]``; nothing is lost."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.support import configs, faultload, ledger, ordering, processes
from tests.support.waiting import wait_until

JOBS = 2_000
KILLS = 4


@pytest.mark.slow
def test_one_worker_sees_each_key_in_staging_order_through_refusals_and_kills(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    ledger.install(database)
    ordering.install(database)
    queue = f"drain-test-{uuid.uuid4().hex[:8]}"
    config = configs.write_config(
        tmp_path / "drain.toml",
        database,
        {"default": configs.rq(redis_db, [ordering.JOB_NAME])},
        retry_base_s=0.5,  # a refused row waits a while: the rows of its key staged meanwhile wait too
    )
    (worker,) = processes.start_workers(redis_db, queue, database, tmp_path, count=1)
    drains = ordering.DrainUnderKills(
        config, tmp_path, lambda: len(ordering.recorded(database)), kills=KILLS, every=JOBS // 8
    )
    with processes.running(worker):
        try:
            load = ordering.KeyedLoad(database, JOBS, queue=queue, pace_s=(0.005, 0.03)).start()
            drains.run_kills()
            result = load.join()

            def delivered() -> bool:
                assert worker.alive(), worker.output()[-3000:]
                return {job_id for job_id, _ in ordering.recorded(database)} >= result.committed.keys()

            wait_until("every committed job to run", delivered, 180)
            ledger.wait_drained(database)
        finally:
            drains.stop()
    deliveries = ordering.recorded(database)
    tally = ledger.tally(database, ordering.counted(deliveries), result.rolled_back)
    report = ordering.check_order(result.committed, {queue: deliveries})
    faultload.report(f"rq per-key order, {drains.killed} kills", tally)
    print(f"order: {report}")

    tally.check()  # lost 0, nothing rolled back delivered
    assert len(tally.committed) == len(result.committed) > JOBS // 2
    assert not tally.dead
    assert drains.killed == KILLS
    report.check()
    assert report.keys == len(ordering.KEYS)
    refusable = {row_id for row_id, _key in result.committed.values() if row_id % ordering.REFUSE_EVERY == 0}
    assert refusable <= ordering.refused_rows(drains.logs), "a fifth of the rows were refused once"
    assert len(refusable) > len(result.committed) // 10
