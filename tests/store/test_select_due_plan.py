"""The batch query stays an index walk with a million future-dated rows in the table."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from drain import config
from drain.store import reading, sql
from drain.store import session as store
from tests.support import configs, processes

FUTURE_ROWS = 1_000_000
PARKED_IN_PLACE = 100


def _plan(conn: psycopg.Connection[object], exclude: list[int]) -> dict[str, object]:
    params = {
        "paused": [],
        "exclude": exclude,
        **reading.Reader(config.BATCH_MAX_BYTES).params(500, config.BATCH_MAX_BYTES),
    }
    return _explain(conn, "select_due", params)


def _explain(conn: psycopg.Connection[object], name: str, params: dict[str, object]) -> dict[str, object]:
    statement = sql.query(name, sql.Names("public", "staged_jobs")).as_string(conn)
    with psycopg.ClientCursor(conn) as cursor:  # literal parameters: the plan a real batch gets
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params)
        row = cursor.fetchone()
    assert row is not None
    document = row[0] if isinstance(row[0], list) else json.loads(row[0])
    plan: dict[str, object] = document[0]["Plan"]
    return plan


def _nodes(plan: dict[str, object]) -> list[dict[str, object]]:
    found = [plan]
    for child in plan.get("Plans", []):  # type: ignore[attr-defined]
        found.extend(_nodes(child))
    return found


@pytest.mark.slow
def test_select_due_uses_indexes_with_a_million_future_rows(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (job_name, run_at) "
            "SELECT 'tests.support.tasks.record', now() + interval '1 day' + g * interval '1 second' "
            "FROM generate_series(1, %s) AS g",
            (FUTURE_ROWS,),
        )
        conn.execute(  # rows parked in place (their parking refused): never due, ahead of the 5
            "INSERT INTO staged_jobs (job_name, last_error) "
            "SELECT 'tests.support.tasks.record', %s || ' refused' FROM generate_series(1, %s)",
            (store.PARKED_IN_PLACE_PREFIX, PARKED_IN_PLACE),
        )
        conn.execute(
            "INSERT INTO staged_jobs (job_name, job_args) "
            "SELECT 'tests.support.tasks.record', jsonb_build_array(g) FROM generate_series(1, 5) AS g"
        )
        conn.execute("ANALYZE staged_jobs")
        # 2,000 ids in flight (pipelined batches), the first of the 5 due rows among them
        (first,) = conn.execute(
            "SELECT min(id) FROM staged_jobs WHERE run_at IS NULL AND last_error IS NULL"
        ).fetchone() or (0,)
        plan = _plan(conn, [first, *range(first + 1_000_000, first + 1_001_999)])
        # the idle leader's question walks the same indexes
        due = _explain(conn, "anything_due", {"dead_blocking": []})

    due_scans = [node for node in _nodes(due) if str(node.get("Relation Name")) == "staged_jobs"]
    assert due_scans and all("Index" in str(node["Node Type"]) for node in due_scans), due_scans

    nodes = _nodes(plan)
    kinds = [str(node["Node Type"]) for node in nodes]
    scans = [node for node in nodes if str(node.get("Relation Name")) == "staged_jobs"]
    assert scans, kinds
    assert all("Index" in str(node["Node Type"]) for node in scans), kinds
    # A scan that ran: the dead letters' probe (key_free) is planned on the empty dead-letter
    # table as a scan, and never runs (no backend here blocks on dead letters).
    ran = [node for node in nodes if node["Node Type"] == "Seq Scan" and node["Actual Loops"]]
    seq = [str(node.get("Relation Name")) for node in ran]
    assert not seq, seq
    assert plan["Actual Rows"] == 4  # the 5 due rows but the one in flight, none parked in place
    # "fast" without a stopwatch: the batch query touches a handful of pages, not the table's
    pages = sum(
        int(str(node.get("Shared Hit Blocks", 0))) + int(str(node.get("Shared Read Blocks", 0)))
        for node in nodes[:1]
    )
    print(f"\nselect_due plan: {kinds}; {pages} pages")
    assert pages < 200, f"select_due read {pages} pages"

    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rq(redis_db, processes.ALLOWED_JOBS)}
    )
    done = processes.drain_cli("run", "--once", "--config", str(config), dsn=database, timeout_s=120)
    assert done.returncode == 0, done.stderr
    assert "published 5," in done.stdout  # nothing in flight for a fresh drain
    with psycopg.connect(database) as conn:
        (left,) = conn.execute("SELECT count(*) FROM staged_jobs").fetchone() or (0,)
    assert left == FUTURE_ROWS + PARKED_IN_PLACE
