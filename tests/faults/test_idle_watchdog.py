"""Idle is not stuck: a watchdog shorter than the loop's waits ends only a loop that is stuck.

An independent review (issue 33, item 3) ran a leader of an empty table with ``watchdog_s = 5``
(``drain check`` accepted it): it exited 1 with a stack dump after 15 s of idling, because the
armed wake-up's wait (``wakeup_poll_max_s``, 10 s by default) was longer than the bound. Every
wait between turns has the same shape — the idle poll, the armed wake-up's, a standby's retry, a
reconnect's and a failed settlement's backoff — so the loop now pets the watchdog with the wait
it takes, and the bound counts after it.

Here, with ``watchdog_s = 1.5``: an idle leader (poll and wake-up waits of 3-4 s) and a standby
(``standby_retry_s = 3``) both stay alive past 3x the bound; then the standby, leading, is
stuck in a failpoint that holds the GIL and is still ended by its watchdog (exit 1).
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.support import configs, faultload, processes
from tests.support.waiting import wait_until

WATCHDOG_S = 1.5
WAITS = {"poll_max_s": 3.0, "wakeup_poll_max_s": 4.0, "standby_retry_s": 3.0}


def test_an_idle_leader_and_a_standby_outlive_a_short_watchdog_and_a_stuck_one_does_not(
    database: str, tmp_path: Path
) -> None:
    faultload.prepare(database)
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.memory()}, watchdog_s=WATCHDOG_S, **WAITS
    )
    leader = processes.start_drain(config, None, tmp_path / "leader.log")
    with processes.running(leader):
        wait_until("a leader", lambda: faultload.leader_pid(database) is not None, faultload.DEADLINE_S)
        standby = processes.start_drain(config, None, tmp_path / "standby.log", failpoints="before_arm=spin")
        with processes.running(standby):
            until = time.monotonic() + 3.5 * WATCHDOG_S
            while time.monotonic() < until:  # sampled: an exit at any moment fails the test
                assert leader.alive(), leader.output()
                assert standby.alive(), standby.output()
                time.sleep(0.2)
            assert "watchdog" not in leader.output() + standby.output()
            assert leader.terminate(30) == 0, leader.output()
            # The standby leads, finds the table empty, and spins before arming: stuck for real.
            assert standby.wait(30) == 1, standby.output()
            assert "most recent call first" in standby.output()
