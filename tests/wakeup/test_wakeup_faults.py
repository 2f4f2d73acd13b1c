"""Lost wake-ups (issue 14): the poll recovers every job a notification did not announce, the
drain says why it missed one, and a leader whose listening session was killed listens again.

- Stage with the trigger disabled, or from a session with ``session_replication_role = replica``
  (triggers do not fire): no notification; the safety-net poll forwards the job, and the log
  names the cause.
- Kill the sleeping leader's session (pg_terminate_backend): a job staged meanwhile is forwarded
  once it reconnects, and on its new session a commit wakes it again within the bound.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import drain
from tests.support import configs, processes
from tests.support.waiting import wait_until
from tests.wakeup.test_wakeup import JOB, WAKE_BOUND_S, queued, wait_for_pickup, wake_lock_holder

SAFETY_NET_S = 2.0  # poll_min_s = poll_max_s = wakeup_poll_max_s: the poll comes every 1-2 s
RECOVERY_BOUND_S = 30.0  # generous: the poll and a reconnect take a few seconds


def start(database: str, redis_db: str, tmp_path: Path, poll_s: float) -> processes.Process:
    path = configs.write_config(
        tmp_path / "drain.toml",
        database,
        {"default": configs.rq(redis_db, allowed_jobs=[JOB])},
        poll_min_s=poll_s,
        poll_max_s=poll_s,
        wakeup_poll_max_s=poll_s,
    )
    return processes.start_drain(path, database, tmp_path / "drain.log")


@pytest.fixture
def polling_drain(database: str, redis_db: str, tmp_path: Path) -> Iterator[processes.Process]:
    process = start(database, redis_db, tmp_path, SAFETY_NET_S)
    with processes.running(process):
        wait_until("the drain to lead and sleep armed", lambda: wake_lock_holder(database), 30)
        yield process


@pytest.mark.parametrize(
    ("break_it", "cause"),
    [
        ("ALTER TABLE staged_jobs DISABLE TRIGGER drain_wake", "missing or disabled"),
        ("SET session_replication_role = replica", "session_replication_role"),
    ],
    ids=["trigger-disabled", "replica-role"],
)
def test_a_lost_notification_is_recovered_by_the_poll(
    polling_drain: processes.Process, database: str, redis_db: str, tmp_path: Path, break_it: str, cause: str
) -> None:
    queue = f"lost-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(break_it)
        with conn.transaction():
            drain.stage(conn, JOB, queue=queue)
    wait_until("the poll to forward the job", lambda: queued(redis_db, queue) == 1, RECOVERY_BOUND_S)
    log = tmp_path / "drain.log"
    wait_until("the missed wake-up logged", lambda: "no notification woke it" in log.read_text(), 10)
    assert cause in log.read_text()


def test_a_killed_listening_session_is_replaced_and_listens_again(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    process = start(database, redis_db, tmp_path, 30.0)  # only a notification explains a fast pickup
    queue = f"killed-{uuid.uuid4().hex[:8]}"
    with processes.running(process):
        sleeper = wait_until("the drain to sleep armed", lambda: wake_lock_holder(database), 30)
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (sleeper,))
            with conn.transaction():  # staged while no session listens: nobody is notified
                drain.stage(conn, JOB, args=[1], queue=queue)
        wait_until("the job staged with no listener", lambda: queued(redis_db, queue) == 1, RECOVERY_BOUND_S)
        again = wait_until("the drain to sleep armed again", lambda: wake_lock_holder(database), 30)
        assert again != sleeper
        with psycopg.connect(database) as conn:
            drain.stage(conn, JOB, args=[2], queue=queue)
        assert wait_for_pickup(redis_db, queue, 2, database) < WAKE_BOUND_S
    assert "lost while it slept" in (tmp_path / "drain.log").read_text()
