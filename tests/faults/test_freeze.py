"""G5: a leader frozen (SIGSTOP) mid-batch longer than idle_in_transaction_session_timeout loses
its session and lock; the hot standby takes over; once continued, the old leader logs the loss
and deletes nothing (the delete audit records which drain deleted each row)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.support import configs, faultload, ledger, processes


def test_frozen_leader_is_fenced_and_the_standby_takes_over(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    faultload.prepare(database)
    load = faultload.stage_committed(database, transactions=80, jobs_per_transaction=5)
    # publish_timeout_s = 1 → the server ends a session idle in a transaction after 11 s
    config_of = {
        name: configs.write_config(
            tmp_path / f"{name}.toml",
            processes.with_application_name(database, name),
            {"default": configs.rq(redis_db)},
            publish_timeout_s=1.0,
            batch_size=50,
        )
        for name in ("drain-a", "drain-b")
    }
    a = faultload.DrainProcess(config_of["drain-a"], tmp_path / "a.log", failpoints="after_publish=stop@2")
    with faultload.running(a):
        ledger.wait_until(a.stopped, faultload.DEADLINE_S, "drain-a to freeze in its second batch")
        frozen_at = time.time()
        frozen_backend = faultload.leader_pid(database)
        assert frozen_backend is not None, "the frozen leader's session should still hold the lock"
        b = faultload.DrainProcess(config_of["drain-b"], tmp_path / "b.log")
        with faultload.running(b):
            faultload.wait_drained(database)
            took_over = faultload.leader_pid(database)
            assert took_over not in (None, frozen_backend)
            assert a.stopped(), "drain-a must still be frozen while drain-b drains"

            a.signal(signal.SIGCONT)
            ledger.wait_until(
                lambda: "lost leadership" in a.log(), faultload.DEADLINE_S, "drain-a to log the lost lock"
            )
            more = faultload.stage_committed(database, transactions=20, jobs_per_transaction=5, seed=5)
            faultload.wait_drained(database)
            assert a.process.poll() is None, a.log()

    with_audit = faultload.scalar(
        database,
        "SELECT count(*) FROM fault_deletes WHERE app = 'drain-a' AND at > to_timestamp(%s)",
        (frozen_at,),
    )
    by_frozen_backend = faultload.scalar(
        database, "SELECT count(*) FROM fault_deletes WHERE pid = %s", (frozen_backend,)
    )
    by_b = faultload.scalar(database, "SELECT count(*) FROM fault_deletes WHERE app = 'drain-b'")
    result = faultload.tally(database, redis_db, load, more)
    faultload.report(
        "SIGSTOP leader > idle_in_transaction_session_timeout",
        result,
        deleted_by_old_leader_after_freeze=with_audit,
        deleted_by_standby=by_b,
    )
    assert with_audit == 0, "the frozen leader deleted rows after it lost its lock"
    assert by_frozen_backend == 50, "only the first batch committed on the frozen leader's session"
    assert by_b > 0
    result.check()
    assert result.duplicates == 0
