"""Red team 32: ``drain dead retry`` puts a keyed dead letter back under its own id
(OVERRIDING SYSTEM VALUE). The docs know ids repeat "once the table's identity restarts or a
table is restored" (dead-letters.md), and dead_retry leaves a dead letter whose id is taken *now*;
but an id the identity has not reached yet is taken *later*: the retried row sits ahead of the
identity, so

- the rows of its key staged after the retry committed get lower ids and go first (G9: "the one
  staged after the other's transaction committed (so with the higher id)" — not so here), and
- when the identity reaches that id, a producer's INSERT fails with a unique violation on the
  primary key: the app's own transaction aborts (drain.stage, drain_stage_v2, a plain INSERT).

Red before main's 076f84e (window looks everywhere every 16th select and after an empty one;
keys bounded in characters; a retried keyed row above the identity gets a new id); kept as a
regression test.
"""

from __future__ import annotations

import psycopg
import pytest

import drain
from drain import cli, testing
from drain.relay import loop as relay
from tests.support.waiting import wait_until


def drain_all(leader: relay.Relay, conn: psycopg.Connection) -> None:
    """Step until the table is empty (rows rejected max_attempts times are dead letters)."""

    def empty() -> bool:
        leader.drain_once()
        return conn.execute("SELECT count(*) FROM staged_jobs").fetchone() == (0,)

    wait_until("the table to empty", empty, 30)


def test_a_keyed_dead_letter_retried_ahead_of_a_restarted_identity(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    memory.behaviour = lambda job: "reject" if job.job_name == "first" else "ack"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO staged_jobs (job_name) SELECT 'filler' FROM generate_series(1, 4)")
        conn.execute("INSERT INTO staged_jobs (job_name, ordering_key) VALUES ('first', 'k')")  # id 5
        drain_all(leader, conn)  # max_attempts 3: 'first' is a dead letter, the fillers forwarded
        assert conn.execute("SELECT id FROM staged_jobs_dead").fetchall() == [(5,)]
        # The operator empties the table and restarts its identity (or restores it elsewhere).
        conn.execute("TRUNCATE staged_jobs RESTART IDENTITY")
        memory.behaviour = lambda job: "ack"
        assert cli.main(["dead", "retry", "--dsn", database], env={}) == cli.EXIT_OK
        assert conn.execute("SELECT job_name FROM staged_jobs").fetchall() == [("first",)]
        # The app stages the key's next job after the retry committed: it gets id 1.
        drain.stage(conn, "second", ordering_key="k")
    memory.published.clear()
    for _ in range(5):
        leader.drain_once()
    order = [job.job_name for job in memory.published]
    # 'first' (staged again, committed) before 'second' (staged after). (red team 32 found otherwise)
    assert order == ["first", "second"], order


def test_a_keyed_dead_letter_retried_ahead_of_the_identity_fails_a_producer_later(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    memory.behaviour = lambda job: "reject"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO staged_jobs (job_name) SELECT 'filler' FROM generate_series(1, 2)")
        conn.execute("INSERT INTO staged_jobs (job_name, ordering_key) VALUES ('first', 'k')")  # id 3
        drain_all(leader, conn)
        conn.execute("DELETE FROM staged_jobs_dead WHERE ordering_key IS NULL")
        conn.execute("TRUNCATE staged_jobs RESTART IDENTITY")
        assert cli.main(["dead", "retry", "--dsn", database], env={}) == cli.EXIT_OK  # 'first' back as id 3
        drain.stage(conn, "app.a")  # id 1
        drain.stage(conn, "app.b")  # id 2
        # the app's next job is staged. (red team 32 found otherwise)
        try:
            drain.stage(conn, "app.c")  # the identity hands out 3
        except psycopg.errors.UniqueViolation as exc:
            pytest.fail(f"a producer's INSERT failed: {exc}")
