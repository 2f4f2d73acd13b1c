"""G1: a private PostgreSQL cluster is stopped with ``-m immediate`` (a crash: no checkpoint, every
session cut) mid-run and started again; the drain reconnects and nothing committed is lost."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import configs, faultload, postgres, processes

DOWN_S = 2.0


@pytest.fixture
def private_postgres() -> Iterator[postgres.PrivatePostgres]:
    if not postgres.available():
        pytest.skip("PostgreSQL server binaries are not installed")
    cluster = postgres.PrivatePostgres()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.slow
def test_postgres_crash_and_restart(
    private_postgres: postgres.PrivatePostgres, redis_db: str, tmp_path: Path
) -> None:
    dsn = private_postgres.migrated_database()
    config = configs.write_config(
        tmp_path / "drain.toml", dsn, {"default": configs.rq(redis_db)}, batch_size=50
    )
    drain = processes.start_drain(config, None, tmp_path / "drain.log")
    load = faultload.load(dsn)

    def crash() -> float:
        private_postgres.crash()
        time.sleep(DOWN_S)  # the outage itself
        private_postgres.start()
        return time.time()

    recovery = faultload.fault_under_load(dsn, drain, load, crash)
    result = faultload.tally(dsn, redis_db, load)
    faultload.report(
        "postgres crash (-m immediate) + restart",
        result,
        recovery_s=f"{recovery:.2f}",
        load_errors=len(load.result.errors),
    )
    result.check()
