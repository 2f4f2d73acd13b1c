"""Stopping a drain, and a drain that stops making progress (G5, G7; issue 10 items 5 and 7).

- ``drain run --once`` honours SIGTERM: the batch in progress finishes, the lock is released,
  exit 0; what was not forwarded stays staged.
- A second SIGTERM exits at once (143): the batch in progress rolls back, nothing is deleted, and
  a later drain forwards everything (lost 0).
- The watchdog: a leader whose loop is stuck between batches — here in a regular expression that
  holds the GIL for ever — dumps its threads and exits non-zero within ``watchdog_s``; its session
  ends with it, a standby takes over, nothing is lost.
- sd_notify: READY=1 on start, WATCHDOG=1 while the loop goes round, STOPPING=1 on SIGTERM.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

from drain import cli
from tests.support import configs, faultload, ledger, processes
from tests.support.load import Load
from tests.support.waiting import wait_until

BATCH = 50
SERIAL = 0  # pipeline_depth: these tests count batches one at a time (each deleted in its own
# step); with RQ's pipelined full batches a step deletes one submitted several steps before


def prepared(
    database: str, redis_db: str, tmp_path: Path, transactions: int = 40, **settings: object
) -> tuple[Path, Load]:
    faultload.prepare(database)
    load = faultload.stage_committed(database, transactions=transactions, per_transaction=5)
    config = configs.write_config(
        tmp_path / "drain.toml",
        database,
        {"default": configs.rq(redis_db)},
        batch_size=BATCH,
        pipeline_depth=SERIAL,
        **settings,
    )
    return config, load


def signal_during_the_second_batch(drain: processes.Process, database: str) -> None:
    """SIGTERM once the first batch committed and the second is held in its failpoint's sleep.

    A batch without the sleep is inside its transaction for milliseconds (between BEGIN and the
    select, too, where a stop ends the step before it reads): only a state that lasts shows the
    second batch publishing."""

    def second_batch() -> bool:
        return in_a_batch(database) and faultload.deleted(database) == BATCH

    def held() -> bool:
        if not second_batch():
            return False
        time.sleep(0.3)  # the sleep failpoint lasts seconds; a batch without it, milliseconds
        return second_batch()

    wait_until("batch 2 held in its failpoint", held, faultload.DEADLINE_S)
    drain.signal(signal.SIGTERM)


def finish_and_count(config: Path, database: str, redis_db: str, load: Load, tmp_path: Path) -> None:
    """A fresh ``drain run --once`` forwards the rest: nothing lost, nothing left."""
    finisher = processes.start_drain(config, None, tmp_path / "finish.log", "--once")
    assert finisher.wait() == cli.EXIT_OK, finisher.output()
    result = faultload.tally(database, redis_db, load)
    result.check()
    assert result.remaining == 0


def in_a_batch(database: str) -> bool:
    """The drain's session is inside a batch transaction (it selected and is publishing)."""
    state = faultload.scalar(
        database,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name LIKE 'drain/%%' AND state = 'idle in transaction'",
    )
    return bool(state)


def test_sigterm_during_once_finishes_the_batch_and_exits_0(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    config, load = prepared(database, redis_db, tmp_path)
    drain = processes.start_drain(
        config, None, tmp_path / "once.log", "--once", failpoints="after_publish=sleep:2@2"
    )
    with processes.running(drain):
        signal_during_the_second_batch(drain, database)
        assert drain.wait(60) == cli.EXIT_OK, drain.output()
    assert faultload.deleted(database) == 2 * BATCH  # the second batch finished; no third began
    assert "Traceback" not in drain.output()
    finish_and_count(config, database, redis_db, load, tmp_path)


def test_a_second_sigterm_exits_at_once_and_loses_nothing(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    config, load = prepared(database, redis_db, tmp_path)
    drain = processes.start_drain(config, None, tmp_path / "run.log", failpoints="after_publish=sleep:60@2")
    with processes.running(drain):
        signal_during_the_second_batch(drain, database)
        wait_until(
            "the first signal",
            lambda: cli.STOPPING_LINE.decode().strip() in drain.output(),
            faultload.DEADLINE_S,
        )
        drain.signal(signal.SIGTERM)
        started = time.monotonic()
        assert drain.wait(30) == cli.EXIT_FORCED, drain.output()
        assert time.monotonic() - started < 10  # at once, not after the 60 s batch
    assert faultload.deleted(database) == BATCH  # the second batch rolled back
    wait_until("the lock to be free", lambda: faultload.leader_pid(database) is None, faultload.DEADLINE_S)
    finish_and_count(config, database, redis_db, load, tmp_path)


@pytest.mark.slow
def test_a_stuck_leader_is_ended_by_its_watchdog_and_a_standby_takes_over(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    config, load = prepared(database, redis_db, tmp_path, transactions=200, watchdog_s=2)
    stuck = processes.start_drain(config, None, tmp_path / "stuck.log", failpoints="after_commit=spin@3")
    with processes.running(stuck):
        wait_until("three batches", lambda: faultload.deleted(database) >= 3 * BATCH, faultload.DEADLINE_S)
        standby = processes.start_drain(config, None, tmp_path / "standby.log")
        with processes.running(standby):
            # While the stuck leader lives it holds the lock, so nothing more is forwarded: sampled
            # until it exits (after that the standby leads at once, and the count moves on).
            while_stuck = set()

            def exited() -> bool:
                if stuck.popen.poll() is not None:
                    return True
                while_stuck.add(faultload.deleted(database))
                return False

            wait_until("the stuck leader to exit", exited, 60)
            code = stuck.wait(30)
            assert code == 1, stuck.output()  # the watchdog's exit, not a crash elsewhere
            assert "most recent call first" in stuck.output()  # every thread's stack, for the post-mortem
            assert "failpoints.py" in stuck.output()  # ... showing where it was stuck
            assert while_stuck == {3 * BATCH}  # it held the lock, forwarding nothing
            ledger.wait_drained(database)
    result = faultload.tally(database, redis_db, load)
    result.check()


def test_sd_notify_ready_watchdog_stopping(database: str, redis_db: str, tmp_path: Path) -> None:
    config, _ = prepared(database, redis_db, tmp_path, transactions=1)
    address = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)
        sock.settimeout(30)
        drain = processes.start_drain(config, None, tmp_path / "run.log", env={"NOTIFY_SOCKET": address})
        with processes.running(drain):
            first = sock.recv(4096).decode()
            assert first.startswith("READY=1") and f"MAINPID={drain.pid}" in first
            assert sock.recv(4096) == b"WATCHDOG=1"
            assert sock.recv(4096) == b"WATCHDOG=1"  # again while the loop goes round
            drain.signal(signal.SIGTERM)
            assert drain.wait(30) == cli.EXIT_OK, drain.output()
        messages = []
        sock.settimeout(1)
        while True:
            try:
                messages.append(sock.recv(4096))
            except TimeoutError:
                break
        assert messages[-1] == b"STOPPING=1"
