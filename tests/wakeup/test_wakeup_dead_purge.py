"""`drain dead purge` of a keyed dead letter releases the rows of its key under
block_on_dead_letter: it wakes a leader asleep on the wake-up, as a producer's commit does (no row
is inserted or updated, so no trigger would fire without it)."""

from __future__ import annotations

import threading
import time

import psycopg

from drain import cli, config, testing
from tests.relay.test_ordering_key_relay import add, bury
from tests.support import relays
from tests.support.waiting import wait_until

POLL_S = 30.0  # poll_min_s = poll_max_s = wakeup_poll_max_s: the safety net alone waits this long
WAKE_BOUND_S = 5.0  # generous; a notification typically lands the job in milliseconds


def test_purging_a_keyed_dead_letter_wakes_the_sleeping_leader(
    settings: config.Settings, database: str
) -> None:
    add(database, "c1", "c")
    held = add(database, "c2", "c")
    bury(database, "c1")
    memory = testing.MemoryAdapter("default")
    leader = relays.leading(
        settings,
        {"default": memory},
        time.monotonic,
        block_on_dead_letter=True,
        poll_min_s=POLL_S,
        poll_max_s=POLL_S,
        wakeup_poll_max_s=POLL_S,
    )
    stop = threading.Event()
    running = threading.Thread(target=leader.run, args=(stop,), daemon=True)
    running.start()
    try:
        assert leader.wakeup is not None
        wait_until(
            "the leader to sleep armed", lambda: leader.wakeup and leader.wakeup.armed, 30, interval_s=0.01
        )
        assert memory.published == []  # c2 waits behind the dead letter of its key
        with psycopg.connect(database) as conn:
            (dead_id,) = conn.execute("SELECT dead_id FROM staged_jobs_dead").fetchone() or (0,)
        assert cli.main(["dead", "purge", "--id", str(dead_id), "--dsn", database], env={}) == cli.EXIT_OK
        wait_until(
            "the held row forwarded", lambda: [job.id for job in memory.published] == [held], WAKE_BOUND_S
        )
    finally:
        stop.set()
        running.join(30)
    assert not running.is_alive()
