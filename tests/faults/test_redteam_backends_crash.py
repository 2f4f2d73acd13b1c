"""Red team (G1 through the new backends): the leader killed (``os._exit(137)``, like SIGKILL)
at every failpoint of a batch (two backends of the kind, so that ``mid_publish``, between
backends, is hit), with pipelined batches in flight (``pipeline_depth`` 3), for NATS
JetStream (a stream of the test's own on the shared server) and Dramatiq on Redis (a Redis db of
the test's own); a restarted drain finishes the table. Counted: committed vs delivered vs dead;
lost must be 0. This held on the current code: it is kept as a regression test."""

from __future__ import annotations

import collections
from pathlib import Path

import psycopg
import pytest
import redis

from tests.support import configs, jetstream, processes, rabbit

STEPS = ["after_select", "mid_publish", "after_publish", "after_delete", "after_commit"]
COMMITTED = 400
QUEUES = ("email", "reports")


def left_and_dead(dsn: str) -> tuple[set[str], int]:
    with psycopg.connect(dsn) as conn:
        left = {str(row[0]) for row in conn.execute("SELECT job_id FROM staged_jobs")}
        dead = conn.execute("SELECT count(*) FROM staged_jobs_dead").fetchone()
    return left, int(dead[0]) if dead else 0


def dramatiq_held(url: str) -> collections.Counter[str]:
    client = redis.Redis.from_url(url)
    try:
        return collections.Counter(
            item.decode().partition(":")[0]  # <job id>:<row id>
            for queue in QUEUES
            for item in client.lrange(f"dramatiq:{queue}", 0, -1)
        )
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.parametrize("failpoint", STEPS)
@pytest.mark.parametrize("kind", ["nats", "dramatiq-redis"])
def test_sigkill_at_each_failpoint_loses_nothing(
    kind: str, failpoint: str, database: str, redis_db: str, tmp_path: Path
) -> None:
    stream = jetstream.unique_name("RTKILL")
    if kind == "nats":
        jetstream.need_nats()
        jetstream.add_stream([jetstream.SHARED_URL], stream, [f"{stream}.*"])
        section = {
            "type": "nats",
            "url": jetstream.SHARED_URL,
            "subject_prefix": stream,
            "queues": list(QUEUES),
        }
    else:
        section = {"type": "dramatiq", "url": redis_db, "allowed_actors": ["app.tasks.record"]}
    try:
        committed: set[str] = set()
        for _part in range(COMMITTED // 20):  # the two backends' rows interleaved: mixed batches
            committed |= rabbit.stage_jobs(database, 10, QUEUES, "b")
            committed |= rabbit.stage_jobs(database, 10, QUEUES, "c")
        config = configs.write_config(
            tmp_path / "drain.toml", database, {"b": section, "c": section}, batch_size=20, pipeline_depth=3
        )
        for kill in range(3):
            crashed = processes.start_drain(
                config, None, tmp_path / f"crashed{kill}.log", failpoints=f"{failpoint}=exit@{2 + kill}"
            )
            assert crashed.wait(60) == 137, crashed.output()
        finisher = processes.start_drain(config, None, tmp_path / "finisher.log", "--once")
        assert finisher.wait(120) == 0, finisher.output()
        left, dead = left_and_dead(database)
        if kind == "nats":
            held = collections.Counter(str(job_id) for job_id in jetstream.held(stream))
        else:
            held = dramatiq_held(redis_db)
    finally:
        if kind == "nats":
            jetstream.delete_stream([jetstream.SHARED_URL], stream)
    lost = committed - set(held) - left
    extra = set(held) - committed
    duplicates = sum(count - 1 for count in held.values() if count > 1)
    print(
        f"{kind} {failpoint}: committed {len(committed)} delivered {len(set(held))} dead {dead} "
        f"left {len(left)} lost {len(lost)} duplicates {duplicates}"
    )
    assert not lost, f"{len(lost)} committed jobs lost"
    assert not extra
    assert dead == 0
    assert not left
