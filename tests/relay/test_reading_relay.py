"""The reader inside the loop, against a real Postgres with the in-memory backends (issue 22): a row
the drain cannot read is rejected without any backend seeing it and dead-lettered like any
rejection, in the step that forwards the rows beside it; a batch stops at its byte budget and says
it is full; batches in flight count against the same budget. A backlog of big rows: the batch
query and the leader's probe read the content of the rows within the budget only (counted in the
toast table's blocks), and an app's lock on one of them is skipped, not waited for; rows that
compress well are cut on their decompressed size."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import psycopg

from drain import config, testing
from drain.store import reading, sql
from drain.store import session as store
from tests.conftest import ManualClock
from tests.support import relays
from tests.support.waiting import steps_until

MIB = 1 << 20


def insert(dsn: str, job_args_sql: str, count: int = 1) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO staged_jobs (job_name, job_args) "
            f"SELECT 'app.tasks.x', {job_args_sql} FROM generate_series(1, %s) AS g",
            (count,),
        )


def test_an_unreadable_row_is_rejected_before_any_backend_and_the_rest_flow(
    settings: config.Settings, clock: ManualClock
) -> None:
    memory = testing.MemoryAdapter("default")
    leader = relays.leading(settings, {"default": memory}, clock, max_attempts=2, retry_base_s=0.0)
    try:
        insert(settings.dsn, "jsonb_build_array(g)", 3)
        insert(settings.dsn, "(repeat('[', 5000) || repeat(']', 5000))::jsonb")
        insert(settings.dsn, "jsonb_build_array(g)", 3)
        first = leader.drain_once()
        assert (first.selected, first.published, first.rejected, first.dead) == (7, 6, 1, 0)
        assert len(memory.published) == 6
        steps_until(leader.drain_once, lambda report: report.dead == 1, "the deep row dead-lettered")
        with psycopg.connect(settings.dsn) as conn:
            (error,) = conn.execute("SELECT error FROM staged_jobs_dead").fetchone() or ("",)
            left = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
        assert error == "the drain cannot read this row: job_args is nested deeper than 64 levels"
        assert left == (0,) and len(memory.published) == 6
    finally:
        leader.shutdown()


def test_a_batch_stops_at_its_byte_budget_and_says_it_is_full(
    settings: config.Settings, clock: ManualClock
) -> None:
    memory = testing.MemoryAdapter("default")
    leader = relays.leading(settings, {"default": memory}, clock, batch_max_bytes=4 * MIB)
    try:
        insert(settings.dsn, "jsonb_build_array(repeat('x', 300000))", 10)  # ~1.2 MB weighed each
        sizes = []
        for _ in range(10):
            report = leader.drain_once()
            sizes.append(report.published)
            if not report.full:
                break
        assert sum(sizes) == 10 and max(sizes) == 3, sizes
        assert report.full is False
    finally:
        leader.shutdown()


def test_batches_in_flight_count_against_the_budget(settings: config.Settings, clock: ManualClock) -> None:
    memory = testing.PipelinedMemoryAdapter("default")
    leader = relays.leading(settings, {"default": memory}, clock, batch_max_bytes=4 * MIB, pipeline_depth=4)
    try:
        insert(settings.dsn, "jsonb_build_array(repeat('x', 300000))", 10)
        in_flight_weight = []
        for _ in range(30):
            report = leader.drain_step()
            in_flight_weight.append(
                sum(job.memory_bytes for flight in leader.forwarder.flights() for job in flight.jobs)
            )
            if not report.full and not leader.in_flight:
                break
        assert max(in_flight_weight) <= 4 * MIB, in_flight_weight
        assert len(memory.published) == 10
    finally:
        leader.shutdown()


BIG_ROW_CHARS = 300_000  # incompressible (hex of md5s): stored and toasted as it is
BIG_ROWS = 80


def stage_big_rows(dsn: str, count: int = BIG_ROWS) -> None:
    chunks = BIG_ROW_CHARS // 32
    insert(
        dsn,
        "jsonb_build_array((SELECT string_agg(md5(random()::text || g || h), '') "
        f"FROM generate_series(1, {chunks}) AS h))",
        count,
    )


def toast_blocks_fetched(conn: psycopg.Connection[Any]) -> int:
    """The blocks of the table's toast (where a big value lives) this transaction has read."""
    row = conn.execute(
        "SELECT pg_stat_get_xact_blocks_fetched(reltoastrelid) FROM pg_class "
        "WHERE oid = 'staged_jobs'::regclass"
    ).fetchone()
    assert row is not None
    return int(row[0])


def toast_blocks_per_row(dsn: str, count: int = BIG_ROWS) -> float:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT pg_relation_size(reltoastrelid) FROM pg_class WHERE oid = 'staged_jobs'::regclass"
        ).fetchone()
    assert row is not None
    return int(row[0]) / 8192 / count


def test_a_backlog_of_big_rows_costs_the_server_only_the_rows_within_the_budget(
    settings: config.Settings,
) -> None:
    """Before: the batch query rendered every due row under the row cap as text (80 here, 500 by
    default) to send the 3 that fit, and the leader's probe did the same."""
    stage_big_rows(settings.dsn)
    per_row = toast_blocks_per_row(settings.dsn)
    assert per_row > 20  # the rows really live in the toast table
    db = store.Store(dataclasses.replace(settings, batch_max_bytes=4 * MIB))
    app = psycopg.connect(settings.dsn)
    try:
        (held,) = app.execute("SELECT min(id) FROM staged_jobs").fetchone() or (0,)
        app.execute("SELECT 1 FROM staged_jobs WHERE id = %s FOR UPDATE", [held])
        with db.batch() as batch:
            db.conn.execute("SET LOCAL lock_timeout = '2s'")  # a wait for the app's lock would fail
            before = toast_blocks_fetched(db.conn)
            jobs = batch.select_due(500)
            read = toast_blocks_fetched(db.conn) - before
        assert batch.over_budget and held not in {job.id for job in jobs}
        assert 1 <= len(jobs) <= 3 and not any(job.unreadable for job in jobs)
        # The rows sent and the one rendered past them, each read twice (its decompressed size,
        # then its text), with a row's worth of margin for blocks two rows share. Before: all 80.
        assert read <= 2 * (len(jobs) + 2) * per_row, (read, per_row)
        leading = store.Store(db.settings)  # as when a drain takes the lead: its reader untaught
        with leading.conn.transaction():  # the probe's own transaction becomes a savepoint of this one
            leading.conn.execute("SET LOCAL lock_timeout = '2s'")
            before = toast_blocks_fetched(leading.conn)
            assert leading.probe_settlement(500) is None
            probed = toast_blocks_fetched(leading.conn) - before
        leading.close()
        print(f"\ntoast blocks: select {read}, probe {probed}, a row {per_row:.0f}")
        # Its select, then each kind of settlement write (a burial copies the rows) of the rows
        # a batch takes, about 11 rows' worth each. Before: all 80 rows rendered, then those.
        assert probed <= 15 * (len(jobs) + 1) * per_row, (probed, per_row)
    finally:
        app.close()
        db.close()
    with psycopg.connect(settings.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM staged_jobs").fetchone() == (BIG_ROWS,)


def sort_space_kb(conn: psycopg.Connection[Any], params: dict[str, Any]) -> int:
    """What the batch query's sorts held at most, in kB: the text of the rows it rendered travels
    through the sort above the rendering (EXPLAIN ANALYZE runs the query)."""
    statement = sql.query("select_due", sql.Names("public", "staged_jobs")).as_string(conn)
    with psycopg.ClientCursor(conn) as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params)
        row = cursor.fetchone()
    assert row is not None
    document = row[0] if isinstance(row[0], list) else json.loads(row[0])
    found, plans = [], [document[0]["Plan"]]
    while plans:
        plan = plans.pop()
        plans.extend(plan.get("Plans", []))
        if plan["Node Type"] == "Sort":
            found.append(int(plan["Sort Space Used"]))
    return max(found)


def test_big_rows_that_compress_well_are_cut_on_their_decompressed_size(settings: config.Settings) -> None:
    """300 KB of JSON each that the table stores in a few KB: cut on stored sizes alone, all 80
    would be rendered as text (24 MB in the sort) for the 3 a 4 MiB budget takes."""
    insert(settings.dsn, f"jsonb_build_array(repeat(md5(g::text), {BIG_ROW_CHARS // 32}))", BIG_ROWS)
    with psycopg.connect(settings.dsn) as conn:
        (stored,) = conn.execute("SELECT max(pg_column_size(job_args)) FROM staged_jobs").fetchone() or (0,)
    assert stored < BIG_ROW_CHARS // 20  # compressed
    reader = reading.Reader(4 * MIB)
    params = {"paused": [], "exclude": [], **reader.params(500, 4 * MIB)}
    with psycopg.connect(settings.dsn) as conn:
        rendered_kb = sort_space_kb(conn, params)
        conn.rollback()
        rows = conn.execute(sql.query("select_due", sql.Names("public", "staged_jobs")), params).fetchall()
    taken = reader.take(rows, 4 * MIB, 0.0)
    assert len(taken.jobs) == 3 and taken.over_budget
    # 1 MiB of text (4 MiB / 4 bytes a character): the 3 sent and the next one, 300 KB each.
    assert rendered_kb <= 4 * BIG_ROW_CHARS // 1000 + 100, rendered_kb
