"""Red team (G1 through NATS JetStream): the path to the server cut, reset and blackholed (a TCP
proxy) while a real ``drain run`` forwards a backlog with pipelined batches: connections drop
after HPUB and before the PubAck, mid-frame and mid-batch. Counted: committed vs in the stream vs
dead; lost must be 0 and nothing dead-lettered. This held on the current code: kept as a
regression test."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest

from tests.support import configs, jetstream, processes, proxy, rabbit
from tests.support.waiting import wait_until


@pytest.mark.slow
def test_cuts_resets_and_blackholes_lose_nothing(database: str, tmp_path: Path) -> None:
    jetstream.need_nats()
    stream = jetstream.unique_name("RTNET")
    host, _, port = jetstream.SHARED_URL.removeprefix("nats://").partition(":")
    path = proxy.Proxy(host, int(port or 4222))
    url = f"nats://127.0.0.1:{path.port}"
    section = {
        "type": "nats",
        "url": url,
        "subject_prefix": stream,
        "publish_timeout_s": 2,
        "connect_timeout_s": 1,
    }
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"b": section}, batch_size=25, pipeline_depth=4
    )
    jetstream.add_stream([jetstream.SHARED_URL], stream, [f"{stream}.*"])
    committed: set[str] = set()
    running = processes.start_drain(config, None, tmp_path / "drain.log")
    try:
        for mode in (proxy.CUT, proxy.RESET, proxy.BLACKHOLE) * 2:
            committed |= rabbit.stage_jobs(database, 300, ("email", "reports"), "b", per_txn=50)
            time.sleep(0.15)
            path.set(mode)
            time.sleep(1.5 if mode == proxy.BLACKHOLE else 0.3)
            path.set(proxy.PASS)
        wait_until("the table empty", lambda: rabbit.staged_count(database) == 0, 120)
        held = jetstream.held(stream)
    finally:
        running.terminate()
        path.close()
        jetstream.delete_stream([jetstream.SHARED_URL], stream)
    with psycopg.connect(database) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs_dead").fetchone()
    dead = int(row[0]) if row else 0
    stored = {str(job_id) for job_id in held}
    duplicates = sum(count - 1 for count in held.values())
    print(f"committed {len(committed)} in the stream {len(stored)} dead {dead} duplicates {duplicates}")
    assert not committed - stored, f"{len(committed - stored)} lost"
    assert dead == 0
