"""G1/G4 on a JetStream cluster: three private nats-server processes on loopback ports, an R3
stream, a drain given all three URLs. Under load, the server that leads the stream is killed
(SIGKILL) and restarted. While the stream elects a new leader its publishes find no responders
or no answer in time (an outage: rows wait, none dead-lettered); jobs whose PubAck was lost are
published again and JetStream, whose new leader rebuilt the duplicate window from the stream,
drops them. Counted: lost 0, dead-lettered 0, duplicates in the stream 0."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats

from tests.support import configs, faultload, jetstream, ledger, processes

BACKEND = "events"
DOWN_S = 2.0


def stream_leader(cluster: jetstream.Cluster, stream: str) -> int:
    """The index of the server leading ``stream`` (its name is n<index>)."""

    async def run() -> str:
        client = await nats.connect(cluster.urls, connect_timeout=5)
        try:
            info = await client.jetstream().stream_info(stream)
            assert info.cluster is not None and info.cluster.leader
            return info.cluster.leader
        finally:
            await client.close()

    return int(asyncio.run(run()).removeprefix("n"))


def test_killing_the_stream_leader_under_load_loses_nothing_and_stores_nothing_twice(
    database: str, tmp_path: Path
) -> None:
    faultload.prepare(database)
    with jetstream.cluster(tmp_path) as cluster:
        stream = jetstream.unique_name("CLUSTER")
        jetstream.add_stream(cluster.urls, stream, [f"{stream}.*"], num_replicas=3)
        load = faultload.load(database, backends=[BACKEND], queues={BACKEND: "work"}, pace_s=0.002)
        section = {
            "type": "nats",
            "url": cluster.urls,
            "subject_prefix": stream,
            "queues": ["work"],
            "connect_timeout_s": 2,
            "max_attempts": 1,  # an outage taken for a row's rejection would dead-letter at once
        }
        config = configs.write_config(
            tmp_path / "drain.toml", database, {BACKEND: section}, publish_timeout_s=5
        )
        drain = processes.start_drain(config, None, tmp_path / "drain.log")
        leader = stream_leader(cluster, stream)

        def kill_the_leader() -> float:
            cluster.kill(leader)
            time.sleep(DOWN_S)  # the outage's length is the fault itself, not a wait for a condition
            cluster.start(leader)
            return time.time()

        faultload.fault_under_load(database, drain, load, kill_the_leader)
        result = ledger.tally(database, jetstream.held(stream, cluster.urls), load.rolled_back)
    faultload.report("nats cluster: stream leader killed under load", result)
    result.check()
    assert not result.dead, f"an outage dead-lettered jobs: {result}"
    assert result.duplicates == 0, "a re-publish inside the window was stored twice"
