"""G1 G6 for the RQ backend behind Redis Sentinel: the master is SIGKILLed under load, the sentinels
promote the replica, and the drain follows by itself. lost 0, dead 0, no duplicate.

The drain names the sentinels, not a Redis (``sentinels``, ``master_name``) and acknowledges a
batch only once a replica has it (``wait_replicas = 1``): Redis replicates asynchronously, so a
job the old master acknowledged just before dying could otherwise be lost by Redis itself, and
"lost" would not tell the drain's loss from the broker's. With WAIT, every job the drain settled
is on the replica that gets promoted; the count is exact. The old master comes back as a replica
of the new one (the promoted master alone cannot satisfy ``wait_replicas``: rows wait until it
does). Jobs are read back from the new master by id, from the RQ queue lists.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import configs, faultload, processes, redis_sentinel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis_sentinel.SentinelTopology]:
    with redis_sentinel.running(tmp_path_factory.mktemp("sentinel")) as started:
        yield started


def test_master_sigkilled_under_load_rq_follows_the_promotion(
    topology: redis_sentinel.SentinelTopology, database: str, tmp_path: Path
) -> None:
    faultload.prepare(database)
    backend = configs.rq(
        "",
        sentinels=topology.sentinel_addresses,
        master_name=redis_sentinel.MASTER_NAME,
        socket_timeout_s=2.0,
        wait_replicas=1,
    )
    del backend["url"]
    config = configs.write_config(tmp_path / "drain.toml", database, {"default": backend}, batch_size=50)
    drain = processes.start_drain(config, None, tmp_path / "drain.log")
    load = faultload.load(database)
    promoted: list[str] = []

    def fail_over() -> float:
        promoted.append(topology.fail_over().url)
        return time.time()

    recovery = faultload.fault_under_load(database, drain, load, fail_over)
    assert "unavailable" in drain.output()
    result = faultload.tally(database, promoted[0], load)
    faultload.report(
        "redis sentinel: master SIGKILL, replica promoted (RQ, wait_replicas 1)",
        result,
        recovery_s=f"{recovery:.2f}",
    )
    result.check()
    assert not result.dead
    assert result.duplicates == 0, result
