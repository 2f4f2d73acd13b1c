"""Red team 32: ``drain run --once`` ("drains what is due and exits", docs/cli.md) stops at its
first select that finds nothing (Relay.drain_due). Since the batch query's window, a select
finds nothing when its first rows are all held back by their key, though rows behind them are
due and free: the window widens only at the *next* select, which --once never makes.

Red before main's 076f84e (window looks everywhere every 16th select and after an empty one;
keys bounded in characters; a retried keyed row above the identity gets a new id); kept as a
regression test.
"""

from __future__ import annotations

import threading

import psycopg

from drain import testing
from drain.relay import loop as relay


def test_run_once_forwards_the_free_rows_behind_a_held_run(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        # A key whose first row waits for its retry, 300 more behind it (longer than the window of
        # a 100-row select), then ten rows without a key.
        conn.execute(
            "INSERT INTO staged_jobs (job_name, ordering_key, run_at) "
            "VALUES ('head', 'k', now() + interval '1 h')"
        )
        conn.execute(
            "INSERT INTO staged_jobs (job_name, ordering_key) SELECT 'held', 'k' FROM generate_series(1, 300)"
        )
        conn.execute("INSERT INTO staged_jobs (job_name) SELECT 'free' FROM generate_series(1, 10)")
    total = leader.drain_due(threading.Event())
    assert total is not None
    # the ten free rows forwarded. (red team 32 found otherwise)
    assert [job.job_name for job in memory.published] == ["free"] * 10
