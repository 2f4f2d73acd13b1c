"""The batch query's half of per-key order (queries.sql key_free), on a real table: a keyed row is
taken only when no lower id of its key is still staged, whatever that row's state; rows without a
key, and other keys, flow past a held key; a keyed dead letter retried goes back under its own id."""

from __future__ import annotations

import dataclasses

import psycopg
import pytest

from drain import cli, config
from drain.config.settings import BackendSettings
from drain.store import reading, sql, writes
from drain.store import session as store


def stage(dsn: str, *rows: tuple[str, str | None]) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [
            conn.execute(
                "INSERT INTO staged_jobs (job_name, ordering_key) VALUES (%s, %s) RETURNING id", row
            ).fetchone()[0]  # type: ignore[index]
            for row in rows
        ]


def due(settings: config.Settings, exclude: tuple[int, ...] = ()) -> list[str]:
    db = store.Store(settings)
    try:
        with db.batch() as batch:
            return [job.job_name for job in batch.select_due(100, exclude=exclude)]
    finally:
        db.close()


def test_a_key_goes_one_row_at_a_time_in_id_order(settings: config.Settings) -> None:
    a1, _, _, _, _ = stage(settings.dsn, ("a1", "a"), ("b1", "b"), ("a2", "a"), ("free", None), ("b2", "b"))
    assert due(settings) == ["a1", "b1", "free"]
    # a1 in flight (a pipelined batch awaiting its confirm) still holds a2
    assert due(settings, exclude=(a1,)) == ["b1", "free"]
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        # a1 waiting for its retry: a2 still waits, even with an earlier run_at of its own
        conn.execute("UPDATE staged_jobs SET run_at = now() + interval '1 hour' WHERE job_name = 'a1'")
        conn.execute("UPDATE staged_jobs SET run_at = now() - interval '1 hour' WHERE job_name = 'a2'")
        assert due(settings) == ["b1", "free"]
        with conn.transaction():  # an app holds a1: skipped, and a2 still waits behind it
            conn.execute("UPDATE staged_jobs SET run_at = NULL WHERE job_name = 'a1'")
            conn.execute("SELECT 1 FROM staged_jobs WHERE job_name = 'a1' FOR UPDATE")
        conn.execute("DELETE FROM staged_jobs WHERE job_name IN ('a1', 'b1')")  # acknowledged
    assert due(settings) == ["a2", "free", "b2"]


@pytest.mark.parametrize("blocking", [False, True])
def test_a_dead_letter_holds_its_key_only_where_the_backend_says(
    settings: config.Settings, blocking: bool
) -> None:
    section = BackendSettings("default", "memory", 3, {}, block_on_dead_letter=blocking)
    settings = dataclasses.replace(settings, backends={"default": section})
    (a1,) = stage(settings.dsn, ("a1", "a"))
    stage(settings.dsn, ("a2", "a"), ("other", "o"))
    db = store.Store(settings)
    try:
        with db.batch() as batch:
            (job,) = [j for j in batch.select_due(100) if j.id == a1]
            assert not batch.bury([writes.Dead(job, "refused", 3)])
    finally:
        db.close()
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT ordering_key FROM staged_jobs_dead").fetchall() == [("a",)]
    assert due(settings) == (["other"] if blocking else ["a2", "other"])
    # drain dead retry: back under its own id, so ahead of a2 again (which, without the
    # setting, the select above took: here it is still staged)
    assert cli.main(["dead", "retry", "--dsn", settings.dsn], env={}) == cli.EXIT_OK
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT id FROM staged_jobs WHERE job_name = 'a1'").fetchone() == (a1,)
    assert due(settings) == ["a1", "other"]


def test_a_run_of_held_rows_is_passed_within_a_step_or_two_not_walked_every_step(
    settings: config.Settings,
) -> None:
    """Rows held back by their key are visited and passed over; each select looks no further
    than a window past its first rows, widened after a select that found nothing, so rows behind
    a longer run are reached a step later — never starved, never a walk of the whole backlog."""
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute(  # a key whose first row waits for its retry, 3,000 more behind it
            "INSERT INTO staged_jobs (job_name, ordering_key, run_at) "
            "VALUES ('head', 'k', now() + interval '1 h')"
        )
        conn.execute(
            "INSERT INTO staged_jobs (job_name, ordering_key) "
            "SELECT 'held', 'k' FROM generate_series(1, 3000)"
        )
        conn.execute("INSERT INTO staged_jobs (job_name) SELECT 'free' FROM generate_series(1, 10)")
    db = store.Store(settings)
    found = []
    try:
        for _ in range(reading.FULL_EVERY):
            with db.batch() as batch:
                found.append(len(batch.select_due(500)))
    finally:
        db.close()
    # the window (1,000 rows) holds only "k"; every FULL_EVERY-th select looks at every row
    assert found == [0] * (reading.FULL_EVERY - 1) + [10]


def test_hot_keys_in_a_backlog_cost_a_select_its_window_not_the_backlog(settings: config.Settings) -> None:
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (job_name, ordering_key) "
            "SELECT 'hot', 'key-' || (g % 100) FROM generate_series(1, 20000) AS g"
        )
        conn.execute("ANALYZE staged_jobs")
        params = {
            "paused": [],
            "exclude": [],
            **reading.Reader(config.BATCH_MAX_BYTES).params(500, config.BATCH_MAX_BYTES),
        }
        statement = sql.query("select_due", sql.Names("public", "staged_jobs")).as_string(conn)
        with psycopg.ClientCursor(conn) as cursor:
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params)
            (document,) = cursor.fetchone()  # type: ignore[misc]
            rows = cursor.execute(statement, params).fetchall()
    assert len(rows) == 100  # one row per key
    visited = [
        int(float(str(node.get("Actual Rows", 0)))) + int(float(str(node.get("Rows Removed by Filter", 0))))
        for node in _nodes(document[0]["Plan"])
        if node.get("Relation Name") == "staged_jobs" and "SubPlan" in str(node.get("Filter"))
    ]
    assert visited and max(visited) <= 1001 + 100, visited  # the window, not the 20,000


def _nodes(plan: dict[str, object]) -> list[dict[str, object]]:
    found = [plan]
    for child in plan.get("Plans", []):  # type: ignore[attr-defined]
        found.extend(_nodes(child))
    return found
