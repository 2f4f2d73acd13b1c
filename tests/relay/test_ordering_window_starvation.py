"""Rows behind a run of rows held back by their key (or locked by an app) longer than the batch
query's window are reached: every reading.FULL_EVERY-th select looks at every row. Red team 32
found them starved for as long as the select's other branch found a row each step (the window
then widened only after an empty select)."""

from __future__ import annotations

import psycopg
import pytest

from drain import testing
from drain.relay import loop as relay
from drain.store import reading

RUN = 300  # rows of the held key: longer than the window of a 100-row select (2 x 100)
STEPS = 40


def insert(conn: psycopg.Connection, name: str, key: str | None, deferred: bool) -> None:
    """A row staged for now, or with a run_at that has passed (the select's other branch)."""
    run_at = "now() - interval '1 hour'" if deferred else "NULL"
    conn.execute(
        f"INSERT INTO staged_jobs (job_name, ordering_key, run_at) VALUES (%s, %s, {run_at})",
        (name, key),
    )


@pytest.mark.parametrize(
    "held_deferred", [False, True], ids=["held-now-trickle-deferred", "held-deferred-trickle-now"]
)
def test_rows_behind_a_long_held_run_are_starved_by_a_trickle_in_the_other_branch(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str, held_deferred: bool
) -> None:
    with psycopg.connect(database, autocommit=True) as conn, psycopg.connect(database) as app:
        insert(conn, "head", "hot", held_deferred)
        for _ in range(RUN):
            insert(conn, "held", "hot", held_deferred)
        insert(conn, "victim", None, held_deferred)  # no key: nothing holds it
        # An app holds the key's first row (G9: "locked by an app"): the run behind it waits.
        app.execute("SELECT 1 FROM staged_jobs WHERE job_name = 'head' FOR UPDATE")
        for _ in range(STEPS):
            insert(conn, "trickle", None, not held_deferred)  # ordinary traffic in the other branch
            leader.turn()
            if any(job.job_name == "victim" for job in memory.published):
                break
        published = [job.job_name for job in memory.published]
        app.rollback()
    assert "held" not in published and "head" not in published  # the key's order held
    assert published.count("trickle") == STEPS or "victim" in published
    # the victim, due all along and held by nothing, is forwarded within FULL_EVERY steps
    assert "victim" in published, f"victim never forwarded in {STEPS} steps ({len(published)} others were)"


def test_without_a_trickle_a_select_that_looks_at_every_row_comes_soon(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    with psycopg.connect(database, autocommit=True) as conn, psycopg.connect(database) as app:
        insert(conn, "head", "hot", False)
        for _ in range(RUN):
            insert(conn, "held", "hot", False)
        insert(conn, "victim", None, False)
        app.execute("SELECT 1 FROM staged_jobs WHERE job_name = 'head' FOR UPDATE")
        for _ in range(reading.FULL_EVERY + 1):
            leader.turn()
        app.rollback()
    assert [job.job_name for job in memory.published] == ["victim"]


def test_without_keys_rows_an_app_locks_starve_the_rows_behind_them_the_same_way(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    """The window also counts rows an app holds a lock on (skipped: SKIP LOCKED): no key at all,
    and rows behind 300 locked ones never go while the other branch has a row each step. Before
    the window, a select skipped locked rows and took the next ones."""
    with psycopg.connect(database, autocommit=True) as conn, psycopg.connect(database) as app:
        for _ in range(RUN):
            insert(conn, "locked", None, False)
        insert(conn, "victim", None, False)
        app.execute("SELECT 1 FROM staged_jobs WHERE job_name = 'locked' FOR UPDATE")
        for _ in range(STEPS):
            insert(conn, "trickle", None, True)
            leader.turn()
            if any(job.job_name == "victim" for job in memory.published):
                break
        published = [job.job_name for job in memory.published]
        app.rollback()
    assert "victim" in published, f"victim never forwarded in {STEPS} steps ({len(published)} others were)"
