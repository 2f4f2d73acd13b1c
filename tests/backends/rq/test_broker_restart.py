"""G1: a private Redis (append-only file, fsync always) is SIGKILLed mid-run and restarted on the
same port and data: every acknowledged enqueue survives, the drain backs off and resumes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import configs, faultload, processes, redis_server

DOWN_S = 2.0


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[redis_server.RedisServer]:
    with redis_server.running(tmp_path / "redis") as server:
        yield server


@pytest.mark.slow
def test_broker_sigkill_and_restart(
    database: str, private_redis: redis_server.RedisServer, tmp_path: Path
) -> None:
    faultload.prepare(database)
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rq(private_redis.url)}, batch_size=50
    )
    drain = processes.start_drain(config, None, tmp_path / "drain.log")
    load = faultload.load(database)

    def kill_and_restart() -> float:
        private_redis.downtime(DOWN_S)
        return time.time()

    recovery = faultload.fault_under_load(database, drain, load, kill_and_restart)
    assert "unavailable" in drain.output()
    result = faultload.tally(database, private_redis.url, load)
    faultload.report("redis SIGKILL + restart (AOF always)", result, recovery_s=f"{recovery:.2f}")
    result.check()
