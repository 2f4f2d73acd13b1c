"""G1/G5: ``pg_terminate_backend`` of the leader's session (found as the advisory-lock holder)
while jobs are staged continuously: the drain notices, reconnects and leads again or stands by
behind the other drain; nothing is lost."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg

from tests.support import configs, faultload, ledger, processes
from tests.support.waiting import wait_until

ROUNDS = 3


def test_terminated_leader_session_recovers(database: str, redis_db: str, tmp_path: Path) -> None:
    faultload.prepare(database)
    drains = [
        processes.start_drain(
            configs.write_config(
                tmp_path / f"{name}.toml",
                processes.with_application_name(database, name),
                {"default": configs.rq(redis_db)},
                batch_size=50,
            ),
            None,
            tmp_path / f"{name}.log",
        )
        for name in ("drain-a", "drain-b")
    ]
    load = faultload.load(database)
    recoveries = []
    with processes.running(*drains):
        load.start()
        try:
            for round_ in range(ROUNDS):
                wait_until(
                    "progress",
                    lambda r=round_: faultload.deleted(database) > 100 * (r + 1),
                    faultload.DEADLINE_S,
                )
                victim = wait_until("a leader", lambda: faultload.leader_pid(database), faultload.DEADLINE_S)
                with psycopg.connect(database, autocommit=True) as conn:
                    conn.execute("SELECT pg_terminate_backend(%s)", (victim,))
                terminated_at = time.time()
                wait_until(
                    "a new leader session",
                    lambda v=victim: faultload.leader_pid(database) not in (None, v),
                    faultload.DEADLINE_S,
                )
                recoveries.append(faultload.recovery_after(database, terminated_at))
        finally:
            load.stop()
        ledger.wait_drained(database)
        assert all(drain.popen.poll() is None for drain in drains)
    logs = "".join(drain.output() for drain in drains)
    assert "lost leadership" in logs
    result = faultload.tally(database, redis_db, load)
    faultload.report(
        "pg_terminate_backend(leader)", result, recovery_s=",".join(f"{r:.2f}" for r in recoveries)
    )
    result.check()
