"""Crash, failover and shutdown of ``drain run`` with real RQ workers (G1 under kill -9, G5, G7)."""

from __future__ import annotations

import random
import time

import psycopg
import pytest

from drain.relay import leadership
from drain.store import connection
from tests.support import ledger, processes
from tests.support.load import Load
from tests.support.rig import Rig
from tests.support.waiting import wait_until

LEADER = """
SELECT a.application_name, a.pid
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = %s AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


def leaders(dsn: str) -> list[tuple[str, int]]:
    """(application_name, backend pid) of every session holding the drain's lock on this table."""
    classid, objid = connection.split_key(leadership.lock_key("public", "staged_jobs"))
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [(str(name), int(pid)) for name, pid in conn.execute(LEADER, (classid, objid))]


@pytest.mark.slow
def test_kill_9_at_random_moments_loses_nothing(rig: Rig) -> None:
    rng = random.Random()
    load = Load(rig.dsn, 6_000, threads=3, per_transaction=(1, 6), pace_s=(0, 0.06), queue=rig.queue).start()
    kills = busy = 0
    try:
        while kills < 24:
            drain = rig.start_drain(f"drain-{kills}")
            wait_until("the drain to lead", lambda: leaders(rig.dsn), 60, interval_s=0.02)
            time.sleep(rng.uniform(0.0, 0.4))  # a random moment of its term, not a condition
            drain.kill()
            kills += 1
            busy += ledger.tally(rig.dsn).remaining > 0
    finally:
        load.stop()
    result, tally = rig.finish(load, "drain-final")
    print(f"\n{kills} SIGKILLs ({busy} with rows staged), {result.transactions} transactions: {tally}")
    assert busy > 0, "no kill landed while rows were waiting"
    assert not tally.lost
    assert not tally.phantom
    assert tally.early == 0
    assert tally.duplicates == 0, "RQ already held these job ids: the adapter should have skipped them"


def test_standby_takes_over_when_the_leader_is_killed(rig: Rig) -> None:
    names = ("drain-a", "drain-b")
    drains = {
        name: processes.start_drain(rig.config_for(name), rig.dsn, rig.tmp / f"{name}.log") for name in names
    }
    load = Load(rig.dsn, 3_000, threads=2, per_transaction=(1, 5), pace_s=(0, 0.04), queue=rig.queue).start()
    with processes.running(*drains.values()):
        holders = wait_until("a leader", lambda: leaders(rig.dsn), 60)
        assert len(holders) == 1
        leader_name = holders[0][0]
        standby_name = next(name for name in names if name != leader_name)
        reported = processes.status(rig.config, rig.dsn)["leader"]
        assert reported is not None and reported["application_name"] == leader_name
        wait_until("deliveries", lambda: len(ledger.tally(rig.dsn).delivered) > 100, 120)
        assert "leading" in drains[leader_name].output()
        assert "leading" not in drains[standby_name].output(), "the standby forwarded too"

        drains[leader_name].kill()
        killed = time.monotonic()
        wait_until(
            "the standby to lead",
            lambda: [h for h in leaders(rig.dsn) if h[0] == standby_name],
            60,
            interval_s=0.01,
        )
        takeover_s = processes.elapsed(killed)
        result = load.join()
        tally = ledger.wait_drained(rig.dsn, len(result.committed))
        assert drains[standby_name].alive()
    print(f"\ntakeover after SIGKILL of the leader: {takeover_s:.2f}s; {tally}")
    assert not tally.lost
    assert not tally.phantom
    assert takeover_s < 10  # standby_retry_s is 0.2 s here; the README quotes 0.07 s


def test_sigterm_exits_0_releases_the_lock_and_loses_nothing(rig: Rig) -> None:
    load = Load(
        rig.dsn, 100_000, threads=2, per_transaction=(1, 5), pace_s=(0, 0.04), queue=rig.queue
    ).start()
    try:
        drain = rig.start_drain()
        with processes.running(drain):
            wait_until("deliveries", lambda: len(ledger.tally(rig.dsn).delivered) > 200, 120)
            code = drain.terminate()
            assert code == 0, drain.output()
            assert leaders(rig.dsn) == [], "the lock outlived the drain"
            assert "released leadership" in drain.output()
            assert "Traceback" not in drain.output()
        # the stream goes on without a drain for a moment
        wait_until("rows left staged", lambda: ledger.tally(rig.dsn).remaining > 0, 60)
    finally:
        load.stop()
    _, tally = rig.finish(load, "successor")
    print(f"\nSIGTERM exit 0, lock released; {tally}")
    assert not tally.lost
    assert not tally.phantom
