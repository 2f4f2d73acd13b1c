"""G1 G6 for Dramatiq on Redis behind Sentinel: the master is SIGKILLed under load, the sentinels
promote the replica, and the drain follows by itself. lost 0, dead 0, no duplicate.

As for RQ (tests/backends/rq/test_redis_sentinel_rq.py): the drain names the sentinels, not a
Redis, and acknowledges a batch only once a replica has it (``wait_replicas = 1``), so every job
the drain settled is on the promoted replica and the count is exact. Jobs are read back from the
new master by id, from Dramatiq's queue lists; a job sent again after the failover (its batch's
reply lost with the master) is found in its queue's hash and not written twice.
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support import configs, faultload, ledger, processes, redis_sentinel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis_sentinel.SentinelTopology]:
    with redis_sentinel.running(tmp_path_factory.mktemp("sentinel")) as started:
        yield started


def enqueued(redis_url: str, queues: set[str]) -> collections.Counter[uuid.UUID]:
    """How many times each job id is in these Dramatiq queues' lists."""
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        listed: collections.Counter[uuid.UUID] = collections.Counter()
        for queue in queues:
            items = client.lrange(f"dramatiq:{queue}", 0, -1)  # each <job id>:<row id>
            listed.update(uuid.UUID(item.decode().partition(":")[0]) for item in items)
        return listed
    finally:
        client.close()


def test_master_sigkilled_under_load_dramatiq_follows_the_promotion(
    topology: redis_sentinel.SentinelTopology, database: str, tmp_path: Path
) -> None:
    faultload.prepare(database)
    backend = {
        "type": "dramatiq",
        "sentinels": topology.sentinel_addresses,
        "master_name": redis_sentinel.MASTER_NAME,
        "allowed_actors": [faultload.JOB_NAME],
        "publish_timeout_s": 2.0,
        "wait_replicas": 1,
    }
    config = configs.write_config(tmp_path / "drain.toml", database, {"default": backend}, batch_size=50)
    drain = processes.start_drain(config, None, tmp_path / "drain.log")
    load = faultload.load(database, queue="dramatiq_sentinel")
    promoted: list[str] = []

    def fail_over() -> float:
        promoted.append(topology.fail_over().url)
        return time.time()

    recovery = faultload.fault_under_load(database, drain, load, fail_over)
    assert "unavailable" in drain.output()
    queues = set(load.queues.values())
    result = ledger.tally(database, enqueued(promoted[0], queues), load.rolled_back)
    faultload.report(
        "redis sentinel: master SIGKILL, replica promoted (Dramatiq, wait_replicas 1)",
        result,
        recovery_s=f"{recovery:.2f}",
    )
    result.check()
    assert not result.dead
    assert result.duplicates == 0, result
