"""A REPEATABLE READ transaction held open by another client during heavy churn holds back the
xmin horizon (dead rows pile up in the queue table); the drain must keep going: it keeps at
least a third of its throughput while the snapshot is held (checked to be held: the holder's
backend_xmin is set and does not move), and nothing is lost."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest

from tests.support import configs, faultload, ledger, processes
from tests.support.waiting import wait_until

WINDOW_S = 5.0


@pytest.mark.slow
def test_drain_progresses_under_a_long_repeatable_read_transaction(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    faultload.prepare(database)
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rq(redis_db)}, batch_size=200
    )
    drain = processes.start_drain(config, None, tmp_path / "drain.log")
    load = faultload.load(database, per_transaction=20, pace_s=0)
    with processes.running(drain):
        load.start()
        try:
            wait_until("the drain to start", lambda: faultload.deleted(database) > 200, faultload.DEADLINE_S)
            before_start = time.time()
            time.sleep(WINDOW_S)  # a measurement window, not a synchronisation
            before = faultload.throughput(database, before_start, time.time())
            with psycopg.connect(database, autocommit=True) as holder:
                holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                holder.execute("SELECT count(*) FROM staged_jobs").fetchone()  # takes the snapshot
                horizon = held_xmin(database, holder.info.backend_pid)
                assert horizon is not None, "no snapshot is held"
                during_start = time.time()
                deleted_at_start = faultload.deleted(database)
                time.sleep(WINDOW_S)
                during = faultload.throughput(database, during_start, time.time())
                wait_until(
                    "progress during it",
                    lambda: faultload.deleted(database) > deleted_at_start + 100,
                    faultload.DEADLINE_S,
                )
                assert held_xmin(database, holder.info.backend_pid) == horizon  # held all along
                holder.execute("ROLLBACK")
        finally:
            load.stop()
        ledger.wait_drained(database)
    result = faultload.tally(database, redis_db, load)
    faultload.report(
        "long REPEATABLE READ transaction",
        result,
        jobs_per_s_before=f"{before:.0f}",
        jobs_per_s_during=f"{during:.0f}",
    )
    result.check()
    assert during >= before / 3, f"{during:.0f} jobs/s under the held snapshot, {before:.0f} before"


def held_xmin(database: str, pid: int) -> object:
    return faultload.scalar(database, "SELECT backend_xmin FROM pg_stat_activity WHERE pid = %s", (pid,))
