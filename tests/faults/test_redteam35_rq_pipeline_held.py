"""Red team 35: the pipelined RQ backend under faults with full batches in flight. Tried; these hold.

Real ``drain run`` processes over a backlog (batch_size 50, pipeline_depth 4, so several full
batches' script calls are in flight on the adapter's own connection at any moment):

- SIGKILL at random moments, restarted each time, then ``drain run --once``: nothing lost, no
  job twice in RQ's queue (the script skips a job whose hash carries this row's mark);
- SIGTERM during ``drain run --once``: it exits 0 with every flight settled (no job in Redis
  whose row is still staged);
- a backend-wide refusal injected mid-backlog (READONLY, OOM, MISCONF, a shared ``rq:queues`` of
  the wrong type) with ``max_attempts = 1``, then healed: an outage, nothing dead-lettered,
  nothing lost, no duplicate.
"""

from __future__ import annotations

import random
import signal
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.support import configs, faultload, processes, redis_refusals, redis_server
from tests.support.waiting import wait_until

REFUSALS = [
    *(refusal for refusal in redis_refusals.REFUSALS if refusal.code in {"READONLY", "OOM", "MISCONF"}),
    redis_refusals.wrong_type("rq:queues"),
]


def test_sigkill_at_random_moments_with_batches_in_flight(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    faultload.prepare(database)
    queues = {name: f"rt35-{name}-{uuid.uuid4().hex[:6]}" for name in ("default", "second")}
    load = faultload.stage_committed(
        database, backends=list(queues), queues=queues, transactions=600, per_transaction=5
    )
    config = configs.write_config(
        tmp_path / "drain.toml",
        database,
        {name: configs.rq(redis_db) for name in queues},
        batch_size=50,
        pipeline_depth=4,
    )
    moments = random.Random(35)
    for index in range(8):
        killed = processes.start_drain(config, None, tmp_path / f"killed-{index}.log")
        time.sleep(moments.uniform(0.3, 1.5))
        killed.kill()
    finished = processes.start_drain(config, None, tmp_path / "once.log", "--once")
    assert finished.wait() == 0, finished.output()
    result = faultload.tally(database, redis_db, load)
    faultload.report("rq pipelined, SIGKILL x8", result)
    result.check()
    assert (result.remaining, result.duplicates, len(result.dead)) == (0, 0, 0)


def test_sigterm_during_once_settles_every_flight(database: str, redis_db: str, tmp_path: Path) -> None:
    faultload.prepare(database)
    queues = {"default": f"rt35-term-{uuid.uuid4().hex[:6]}"}
    load = faultload.stage_committed(
        database, backends=list(queues), queues=queues, transactions=3000, per_transaction=5
    )
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rq(redis_db)}, batch_size=50, pipeline_depth=4
    )
    for index in range(3):
        once = processes.start_drain(config, None, tmp_path / f"once-{index}.log", "--once")
        wait_until("progress", lambda index=index: faultload.deleted(database) > 1000 * (index + 1), 30)
        once.signal(signal.SIGTERM)
        assert once.wait(30) == 0, once.output()
        with psycopg.connect(database) as conn:
            staged = {row[0] for row in conn.execute("SELECT job_id FROM staged_jobs")}
        assert not staged & set(faultload.delivered(redis_db, queues.values())), "published, not deleted"
    finished = processes.start_drain(config, None, tmp_path / "final.log", "--once")
    assert finished.wait(60) == 0, finished.output()
    result = faultload.tally(database, redis_db, load)
    result.check()
    assert (result.remaining, result.duplicates) == (0, 0)


@pytest.mark.parametrize("refusal", REFUSALS, ids=[refusal.code for refusal in REFUSALS])
def test_a_refusal_with_batches_in_flight_is_an_outage(
    refusal: redis_refusals.Refusal, database: str, tmp_path: Path
) -> None:
    faultload.prepare(database)
    with redis_server.running(tmp_path / "redis") as server:
        queues = {"default": f"rt35-refused-{uuid.uuid4().hex[:6]}"}
        load = faultload.stage_committed(
            database, backends=list(queues), queues=queues, transactions=3000, per_transaction=5
        )
        config = configs.write_config(
            tmp_path / "drain.toml",
            database,
            {"default": configs.rq(server.url, socket_timeout_s=1.0)},
            batch_size=50,
            pipeline_depth=4,
            max_attempts=1,
        )
        drain = processes.start_drain(config, None, tmp_path / "drain.log")
        try:
            wait_until("progress", lambda: faultload.remaining(database) < 11_000, 30)
            heal = refusal.inject(server)
            time.sleep(2.0)
            heal()
            wait_until("drained", lambda: faultload.remaining(database) == 0, 60)
        finally:
            drain.stop()
        result = faultload.tally(database, server.url, load)
        faultload.report(f"rq pipelined, {refusal.code} mid-backlog", result)
        result.check()
        assert (result.duplicates, len(result.dead)) == (0, 0), drain.output()[-2000:]
