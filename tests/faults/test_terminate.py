"""G1/G5: ``pg_terminate_backend`` of the leader's session (found as the advisory-lock holder)
while jobs are staged continuously: the drain notices, reconnects and leads again or stands by
behind the other drain; nothing is lost."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg

from tests.support import configs, faultload, ledger, processes

ROUNDS = 3


def test_terminated_leader_session_recovers(database: str, redis_db: str, tmp_path: Path) -> None:
    faultload.prepare(database)
    drains = [
        faultload.DrainProcess(
            configs.write_config(
                tmp_path / f"{name}.toml",
                processes.with_application_name(database, name),
                {"default": configs.rq(redis_db)},
                batch_size=50,
            ),
            tmp_path / f"{name}.log",
        )
        for name in ("drain-a", "drain-b")
    ]
    load = faultload.LoadGenerator(database)
    recoveries = []
    with faultload.running(*drains):
        load.start()
        try:
            for round_ in range(ROUNDS):
                ledger.wait_until(
                    lambda r=round_: faultload.deleted(database) > 100 * (r + 1),
                    faultload.DEADLINE_S,
                    "progress",
                )
                victim = ledger.wait_until(
                    lambda: faultload.leader_pid(database), faultload.DEADLINE_S, "a leader"
                )
                with psycopg.connect(database, autocommit=True) as conn:
                    conn.execute("SELECT pg_terminate_backend(%s)", (victim,))
                terminated_at = time.time()
                ledger.wait_until(
                    lambda v=victim: faultload.leader_pid(database) not in (None, v),
                    faultload.DEADLINE_S,
                    "a new leader session",
                )
                recoveries.append(faultload.recovery_after(database, terminated_at))
        finally:
            load.stop()
        faultload.wait_drained(database)
        assert all(drain.process.poll() is None for drain in drains)
    logs = "".join(drain.log() for drain in drains)
    assert "lost leadership" in logs
    result = faultload.tally(database, redis_db, load)
    faultload.report(
        "pg_terminate_backend(leader)", result, recovery_s=",".join(f"{r:.2f}" for r in recoveries)
    )
    result.check()
