"""G1 G6 for Celery on Redis behind Sentinel, with real ``celery worker``s: the master is SIGKILLed
under load, the sentinels promote the replica, and the drain follows by itself. lost 0, dead 0.

Drain and workers are configured as Celery users write it: ``broker_url =
"sentinel://h1;sentinel://h2;sentinel://h3"`` with ``broker_transport_options = {master_name =
...}``. The drain acknowledges a batch only once a replica has it (``wait_replicas = 1``), so the
async replication cannot lose what the drain settled (see test_redis_sentinel_rq.py); the old
master comes back as a replica of the new one.

kombu's Redis consumer pops a message before it records it as unacknowledged, so a broker killed
in between loses that message on the *worker's* side, whatever published it. To count what the
drain guarantees, the first worker is stopped (gracefully: it puts back what it held) before the
master is killed, and a second one, through the sentinels, runs the rest after the promotion.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import celery_rig, ledger, processes, rabbit, redis_sentinel
from tests.support.load import Load
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

JOBS = 2_000
PACE_S = 0.02  # between transactions of each staging thread: the load outlasts the failover
RUN_BEFORE_KILL = 200
DRAINED_TIMEOUT_S = 300.0  # a deadline: one solo worker on a machine others load heavily


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis_sentinel.SentinelTopology]:
    with redis_sentinel.running(tmp_path_factory.mktemp("sentinel")) as started:
        yield started


def delivered(database: str) -> int:
    return len(ledger.tally(database).delivered)


def test_master_sigkilled_under_load_celery_follows_the_promotion(
    topology: redis_sentinel.SentinelTopology, database: str, tmp_path: Path
) -> None:
    ledger.install(database)
    queue = rabbit.unique_name("celery-sentinel")
    url = ";".join(f"sentinel://{address}/0" for address in topology.sentinel_addresses)
    transport = {"master_name": redis_sentinel.MASTER_NAME}
    config = celery_rig.write_config(
        tmp_path / "drain.toml",
        database,
        url,
        batch_size=200,
        publish_timeout_s=5.0,
        backend={"broker_transport_options": transport, "wait_replicas": 1},
    )
    first = celery_rig.start_worker(
        url, queue, database, tmp_path / "worker-1.log", transport_options=transport
    )
    drain = processes.start_drain(config, database, tmp_path / "drain.log")
    with processes.running(drain):
        with processes.running(first):
            celery_rig.wait_ready(first)
            load = Load(database, JOBS, threads=2, queue=queue, pace_s=(0, 2 * PACE_S)).start()
            wait_until("tasks to run before the kill", lambda: delivered(database) >= RUN_BEFORE_KILL, 60)
        at_kill = ledger.tally(database)
        topology.fail_over()
        second = celery_rig.start_worker(
            url, queue, database, tmp_path / "worker-2.log", transport_options=transport
        )
        with processes.running(second):
            result = load.join()
            tally = ledger.wait_drained(database, len(result.committed), timeout_s=DRAINED_TIMEOUT_S)
        assert drain.alive(), drain.output()[-3000:]
        log = drain.output()
    print(f"\nFAULT redis sentinel: master SIGKILL, replica promoted (Celery, wait_replicas 1): {tally}")
    assert "unavailable" in log
    assert len(at_kill.committed) < len(tally.committed), "the master died after the load, not during it"
    assert len(tally.committed) == len(result.committed) > JOBS // 3
    assert not tally.lost, "G1: a committed task never ran"
    assert not tally.dead, "G6: a broker failover dead-lettered a job"
    assert not tally.phantom
    assert tally.early == 0
