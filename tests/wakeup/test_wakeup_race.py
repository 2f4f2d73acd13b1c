"""The wake-up race (issue 22): no commit slips between "nothing due soon" and armed.

An idle leader asks "when is the next row due?", then arms its wake-up (takes the wake lock,
LISTENs, checks that nothing is due). A row due a second ahead, committed between the two,
notified nobody (the lock was free, so the trigger stayed quiet) and no commit can announce a
``run_at`` passing: unless the armed sleep is capped by the earliest future row as seen *after*
the lock was taken, the row waits for the safety-net poll.

The failpoint ``before_arm=stop@1`` freezes the leader (SIGSTOP) in exactly that window; the
test commits the row, lets the leader go on, and measures when the job reached Redis against
the row's ``run_at``. The safety-net poll sleeps at least ``POLL_S / 2``.
"""

from __future__ import annotations

import datetime
import signal
import time
import uuid
from pathlib import Path

import psycopg

import drain
from tests.support import configs, processes
from tests.support.waiting import wait_until
from tests.wakeup.test_wakeup import JOB, queued

POLL_S = 30.0  # poll_min_s = poll_max_s = wakeup_poll_max_s: the safety net sleeps 15-30 s
DUE_IN_S = 1.0
LATE_BOUND_S = 7.5  # half the shortest safety-net sleep: "when it fell due", not "on the poll"


def test_a_row_committed_between_the_due_check_and_arming_is_forwarded_when_it_falls_due(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    queue = f"race-{uuid.uuid4().hex[:8]}"
    config = configs.write_config(
        tmp_path / "drain.toml",
        database,
        {"default": configs.rq(redis_db, allowed_jobs=[JOB])},
        poll_min_s=POLL_S,
        poll_max_s=POLL_S,
        wakeup_poll_max_s=POLL_S,
    )
    leader = processes.start_drain(config, None, tmp_path / "drain.log", failpoints="before_arm=stop@1")
    with processes.running(leader):
        wait_until("the idle leader to freeze before arming", leader.stopped, 60)
        with psycopg.connect(database) as conn:
            drain.stage(conn, JOB, args=[1], queue=queue, delay=DUE_IN_S)
            row = conn.execute("SELECT run_at FROM staged_jobs").fetchone()
        assert row is not None
        run_at: datetime.datetime = row[0]
        leader.signal(signal.SIGCONT)
        wait_until("the job on the queue", lambda: queued(redis_db, queue) == 1, 2 * POLL_S, interval_s=0.02)
        late_s = time.time() - run_at.timestamp()
        assert leader.popen.poll() is None, leader.output()
    assert late_s < LATE_BOUND_S, f"forwarded {late_s:.1f} s after its run_at: it waited for the poll"
