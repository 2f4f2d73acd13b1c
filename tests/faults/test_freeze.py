"""G5: a frozen (SIGSTOPped) leader loses its session and lock, and the hot standby takes over:

- frozen mid-batch, after idle_in_transaction_session_timeout;
- frozen idle between batches, after the idle_session_timeout the drain derives for its own
  sessions from its longest silence (before, it turned that timeout off and a frozen idle leader
  kept the lock for as long as it stayed frozen).

Once continued, the old leader logs the loss, deletes nothing and does not lead beside the new one
(the delete audit records which drain deleted each row)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from drain import config
from drain.store import connection
from tests.support import configs, faultload, ledger, processes
from tests.support.waiting import wait_until


def test_frozen_leader_is_fenced_and_the_standby_takes_over(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    faultload.prepare(database)
    load = faultload.stage_committed(database, transactions=80, per_transaction=5)
    # publish_timeout_s = 1 → the server ends a session idle in a transaction after 11 s
    config_of = {
        name: configs.write_config(
            tmp_path / f"{name}.toml",
            processes.with_application_name(database, name),
            {"default": configs.rq(redis_db)},
            publish_timeout_s=1.0,
            batch_size=50,
            pipeline_depth=0,  # one batch a step: the first is deleted before the second freezes
        )
        for name in ("drain-a", "drain-b")
    }
    a = processes.start_drain(
        config_of["drain-a"], None, tmp_path / "a.log", failpoints="after_publish=stop@2"
    )
    with processes.running(a):
        wait_until("drain-a to freeze in its second batch", a.stopped, faultload.DEADLINE_S)
        frozen_at = time.time()
        frozen_backend = faultload.leader_pid(database)
        assert frozen_backend is not None, "the frozen leader's session should still hold the lock"
        b = processes.start_drain(config_of["drain-b"], None, tmp_path / "b.log")
        with processes.running(b):
            ledger.wait_drained(database)
            took_over = faultload.leader_pid(database)
            assert took_over not in (None, frozen_backend)
            assert a.stopped(), "drain-a must still be frozen while drain-b drains"

            a.signal(signal.SIGCONT)
            wait_until(
                "drain-a to log the lost lock", lambda: "lost leadership" in a.output(), faultload.DEADLINE_S
            )
            more = faultload.stage_committed(database, transactions=20, per_transaction=5, seed=5)
            ledger.wait_drained(database)
            assert a.popen.poll() is None, a.output()

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


def sessions_of(dsn: str, pid: int) -> int:
    return int(faultload.scalar(dsn, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)))


def freeze_idle(drain: processes.Process, dsn: str, backend: int) -> bool:
    """SIGSTOP ``drain``; True if its session is idle (not in a transaction, which the
    idle-in-transaction timeout would end), else SIGCONT it again for another try."""
    drain.signal(signal.SIGSTOP)
    wait_until("the drain to stop", drain.stopped, 10)
    state = faultload.scalar(dsn, "SELECT state FROM pg_stat_activity WHERE pid = %s", (backend,))
    if state == "idle":
        return True
    drain.signal(signal.SIGCONT)
    return False


@pytest.mark.slow
def test_a_leader_frozen_while_idle_loses_the_lock_within_the_derived_bound(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    faultload.prepare(database)
    config_of = {
        name: configs.write_config(
            tmp_path / f"{name}.toml",
            processes.with_application_name(database, name),
            {"default": configs.rq(redis_db)},
            wakeup_poll_max_s=1.0,
        )
        for name in ("drain-a", "drain-b")
    }
    settings = config.load(config_of["drain-a"])
    bound_s = connection.idle_session_timeout_ms(settings) / 1000  # 20 s: the settlement retry's 10 s + 10
    first = faultload.stage_committed(database, transactions=20, per_transaction=5)
    a = processes.start_drain(config_of["drain-a"], None, tmp_path / "a.log")
    with processes.running(a):
        ledger.wait_drained(database)
        frozen_backend = wait_until("drain-a leading", lambda: faultload.leader_pid(database), 10)
        wait_until("drain-a frozen while idle", lambda: freeze_idle(a, database, frozen_backend), 30)
        frozen_at = time.time()
        b = processes.start_drain(config_of["drain-b"], None, tmp_path / "b.log")
        with processes.running(b):
            during = faultload.stage_committed(database, transactions=20, per_transaction=5, seed=7)
            deadline_s = bound_s + settings.standby_retry_s * 1.5 + 10.0  # b's start, its lock, its probe
            took_over = wait_until(
                f"drain-b to lead within the derived bound ({bound_s:g} s)",
                lambda: (
                    faultload.leader_pid(database) not in (None, frozen_backend)
                    and faultload.leader_pid(database)
                ),
                deadline_s,
            )
            takeover_s = time.time() - frozen_at
            ledger.wait_drained(database)
            assert a.stopped(), "drain-a must still be frozen while drain-b drains"
            assert sessions_of(database, frozen_backend) == 0, "the server ended the frozen leader's session"

            a.signal(signal.SIGCONT)
            wait_until(
                "drain-a to log the lost lock", lambda: "lost leadership" in a.output(), faultload.DEADLINE_S
            )
            after = faultload.stage_committed(database, transactions=20, per_transaction=5, seed=8)
            ledger.wait_drained(database)
            assert faultload.leader_pid(database) == took_over, "drain-a leads beside drain-b"
            assert a.popen.poll() is None, a.output()
            wait_until("drain-a to stand by", lambda: "standing by: another drain leads" in a.output(), 30)

    deleted_by_a = faultload.scalar(
        database,
        "SELECT count(*) FROM fault_deletes WHERE app = 'drain-a' AND at > to_timestamp(%s)",
        (frozen_at,),
    )
    result = faultload.tally(database, redis_db, first, during, after)
    faultload.report(
        "SIGSTOP idle leader > idle_session_timeout",
        result,
        bound_s=f"{bound_s:g}",
        takeover_s=f"{takeover_s:.1f}",
        deleted_by_old_leader_after_freeze=deleted_by_a,
    )
    assert deleted_by_a == 0, "the frozen leader deleted rows after it lost its lock"
    result.check()
    assert result.duplicates == 0, "an idle leader had nothing in flight to publish twice"
