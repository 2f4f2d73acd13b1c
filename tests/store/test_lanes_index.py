"""A member leading some lanes of a table reads them through the lanes index and function of its
count (``drain migrate`` with ``lanes``; queries.sql due_now_lanes): the rows the walk of the due
index takes, no row locked that it does not take, nothing of the planner's settings left to the
rest of the batch, and a walk again when the index or the function is not what it should be."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql as pgsql

from drain import config, errors, names
from drain.store import migrations, reading, sql, writes
from drain.store import session as store
from tests.support import configs, processes
from tests.support import lanes as lanes_support

LANES = 8
NAMES = sql.Names("public", "staged_jobs")
INDEX = names.lanes_index("staged_jobs", LANES)
FUNCTION = names.lanes_function("staged_jobs", LANES)


PLANNER_SETTINGS = (
    "SELECT current_setting('enable_seqscan'), current_setting('enable_bitmapscan'), current_setting('jit')"
)


def _build(conn: psycopg.Connection[object]) -> None:
    migrations.build_lanes_index(migrations.Autocommit(conn), NAMES, LANES)


def _reader(led: list[int]) -> reading.Reader:
    return lanes_support.lane_reader(LANES, led)


def _params(reader: reading.Reader, limit: int, **extra: object) -> dict[str, object]:
    return {"paused": [], "exclude": "{}", **reader.params(limit, config.BATCH_MAX_BYTES), **extra}


def _taken(conn: psycopg.Connection[object], params: dict[str, object], lane_count: int | None) -> list[int]:
    statement = sql.query("select_due", NAMES, lane_count=lane_count)
    return [row[0] for row in conn.execute(statement, params)]


def _stage(conn: psycopg.Connection[object], count: int) -> None:
    conn.execute(
        "INSERT INTO staged_jobs (job_name, job_id) "
        "SELECT 'tests.support.tasks.record', gen_random_uuid() FROM generate_series(1, %s)",
        (count,),
    )


def _lanes_index_reads(conn: psycopg.Connection[object]) -> int:
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT coalesce(idx_tup_read, 0) FROM pg_stat_user_indexes WHERE indexrelname = %s", (INDEX,)
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def conn(database: str) -> Iterator[psycopg.Connection[object]]:
    with psycopg.connect(database, autocommit=True) as connection:
        yield connection


@pytest.mark.slow
@pytest.mark.parametrize("analyzed", ["with the rows", "empty"])
def test_a_member_reads_each_led_lane_s_first_rows_from_the_index_and_no_more(
    conn: psycopg.Connection[object], analyzed: str
) -> None:
    """100,000 rows over 8 lanes, a member leading 2: its select reads each lane's first window + 1
    entries of the lanes index and takes the rows the walk takes. With statistics taken while the
    table was empty (a drained table, then a backlog), the planner read each whole lane through a
    bitmap and sorted it (18-21 ms a select at 25,000 rows a lane; here 12,500 entries a lane
    read) unless the function turns bitmap and sequential scans off for itself."""
    conn.execute("ALTER TABLE staged_jobs SET (autovacuum_enabled = false)")
    if analyzed == "empty":
        conn.execute("VACUUM ANALYZE staged_jobs")
    _stage(conn, 100_000)
    _build(conn)
    if analyzed != "empty":
        conn.execute("VACUUM ANALYZE staged_jobs")
    reader = _reader([0, 5])
    params = _params(reader, 200)
    assert params["window"] == 400
    before = _lanes_index_reads(conn)
    with conn.transaction(force_rollback=True):
        by_lanes = _taken(conn, params, LANES)
    read = _lanes_index_reads(conn) - before
    with conn.transaction(force_rollback=True):
        walked = _taken(conn, params, None)
    assert by_lanes == walked and len(by_lanes) == 200
    assert 0 < read <= 2 * 401, read


@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from([None, "k1", "k2", "k3", "k4", "k5"]),  # ordering key
            st.sampled_from(["default", "default", "paused"]),  # backend
            st.sampled_from(["due", "due", "due", "parked in place", "future", "fell due"]),
        ),
        min_size=1,
        max_size=60,
    ),
    led=st.lists(st.integers(0, LANES - 1), min_size=1, max_size=LANES // 2, unique=True),
    limit=st.integers(1, 12),
    window=st.integers(0, 20),
    held=st.sets(st.integers(0, 59), max_size=10),
    excluded=st.sets(st.integers(0, 59), max_size=10),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_read_through_the_lanes_index_a_select_takes_the_rows_the_walk_takes(
    conn: psycopg.Connection[object],
    database: str,
    rows: list[tuple[str | None, str, str]],
    led: list[int],
    limit: int,
    window: int,
    held: set[int],
    excluded: set[int],
) -> None:
    """Keyed rows (a key's later rows held back), a paused backend's, rows parked in place, future
    and fallen-due rows, rows in flight, rows an app holds locked: for any lanes led,
    limit and window, both statements take the same rows in the same order."""
    conn.execute("TRUNCATE staged_jobs")
    _build(conn)
    ids = []
    for key, backend, state in rows:
        run_at = {"future": "now() + interval '1 day'", "fell due": "now() - interval '1 minute'"}.get(
            state, "NULL"
        )
        error = writes.PARKED_IN_PLACE_PREFIX + " refused" if state == "parked in place" else None
        row = conn.execute(
            f"INSERT INTO staged_jobs (job_name, backend, ordering_key, last_error, run_at) "
            f"VALUES ('tests.support.tasks.record', %s, %s, %s, {run_at}) RETURNING id",
            (backend, key, error),
        ).fetchone()
        assert row is not None
        ids.append(row[0])
    reader = _reader(sorted(led))
    params = _params(reader, limit, paused=["paused"], window=window)
    params["exclude"] = "{" + ",".join(str(ids[n]) for n in excluded if n < len(ids)) + "}"
    locked = [ids[n] for n in held if n < len(ids)]
    with psycopg.connect(database) as app:
        app.execute("SELECT 1 FROM staged_jobs WHERE id = ANY(%s) FOR UPDATE", (locked,))
        taken = {}
        for lane_count in (None, LANES):
            with conn.transaction(force_rollback=True):
                taken[lane_count] = _taken(conn, params, lane_count)
        app.rollback()
    assert taken[LANES] == taken[None]


def test_a_select_locks_only_the_rows_it_takes_and_leaves_the_planner_as_it_was(
    conn: psycopg.Connection[object], database: str
) -> None:
    """A batch of 20 over 4 led lanes of 8 (window 64: 65 candidates): an app can lock and update
    every candidate the batch did not take while the batch is open, and the batch's transaction
    plans what comes next (an app's trigger) with the session's own settings."""
    _stage(conn, 2_000)
    _build(conn)
    reader = _reader([1, 2, 4, 6])
    params = _params(reader, 20)
    with conn.transaction(force_rollback=True):
        taken = _taken(conn, params, LANES)
        settings_after = conn.execute(PLANNER_SETTINGS).fetchone()
        candidates = conn.execute(
            f"SELECT {FUNCTION}(%s::int[], 65, '{{}}'::text[], '{{}}'::bigint[])",
            (reader.led_lanes,),
        ).fetchone()
        assert candidates is not None
        others = [each for each in candidates[0] if each not in taken]
        with psycopg.connect(database) as app:
            app.execute("SET lock_timeout = '1s'")
            locked = app.execute(
                "SELECT id FROM staged_jobs WHERE id = ANY(%s) FOR UPDATE NOWAIT", (others,)
            ).fetchall()
            app.execute("UPDATE staged_jobs SET attempts = attempts WHERE id = ANY(%s)", (others,))
            app.commit()
    assert len(taken) == 20 and len(others) == 45 and len(locked) == 45
    with conn.cursor() as cursor:
        session = cursor.execute(PLANNER_SETTINGS).fetchone()
    assert settings_after == session


def test_an_index_of_the_name_but_another_definition_does_not_serve(
    conn: psycopg.Connection[object], database: str
) -> None:
    """The lanes index looked for by what it does: the function's scan of a lane planned as an
    ordered read of it. Missing, invalid, or of another definition under its name: the walk."""
    db = store.Store(config.Settings(dsn=database, lanes=LANES))
    try:
        assert not db.lanes_index_ready(LANES), "nothing built"
        _build(conn)
        assert db.lanes_index_ready(LANES)
        conn.execute(f"DROP INDEX {INDEX}")
        conn.execute(f"CREATE INDEX {INDEX} ON staged_jobs (id) WHERE run_at IS NULL")
        assert not db.lanes_index_ready(LANES), "an index on id alone"
        conn.execute(f"DROP INDEX {INDEX}")
        conn.execute(
            f"CREATE INDEX {INDEX} ON staged_jobs ((mod(hashtext(job_id::text) & 2147483647, 8)), id)"
        )
        assert not db.lanes_index_ready(LANES), "another expression"
        conn.execute(f"DROP INDEX {INDEX}")
        _build(conn)
        assert db.lanes_index_ready(LANES)
        conn.execute(f"ALTER FUNCTION {FUNCTION} RESET enable_bitmapscan")
        assert not db.lanes_index_ready(LANES), "the function without one of its settings"
        _build(conn)
        assert db.lanes_index_ready(LANES)
        conn.execute(f"DROP FUNCTION {FUNCTION}")
        assert not db.lanes_index_ready(LANES), "the function dropped"
    finally:
        db.close()


BREAK_FUNCTION = {
    "dropped": f"DROP FUNCTION {FUNCTION}",
    "failing": (
        f"CREATE OR REPLACE FUNCTION {FUNCTION}(int[], bigint, text[], bigint[]) RETURNS bigint[] "
        "LANGUAGE sql AS 'SELECT ARRAY[1 / 0]::bigint[]'"
    ),
}


@pytest.mark.parametrize("how", sorted(BREAK_FUNCTION))
def test_a_lanes_function_dropped_or_failing_fails_one_select_then_the_member_walks(
    conn: psycopg.Connection[object], database: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The walk takes the same rows: a lanes select that fails for a reason of its own (not a
    row changed since the snapshot, a lost connection, a timeout) says to select again
    (SelectAgain: the relay does at once, as after a serialization failure) and sends the member
    back to the walk until the function is replaced, saying so."""
    _stage(conn, 100)
    _build(conn)
    db = store.Store(config.Settings(dsn=database, lanes=LANES))
    try:
        reader = db.reader
        reader.lane_count, reader.led_count, reader.led_lanes = LANES, 2, "{0,1}"
        reader.other_lanes, reader.lanes_indexed = "{2,3,4,5,6,7}", True
        conn.execute(BREAK_FUNCTION[how])
        with pytest.raises(errors.SelectAgain), db.batch() as batch:
            batch.select_due(10)
        assert not reader.lanes_indexed
        assert [r for r in caplog.records if getattr(r, "event", None) == "lanes_select_failed"]
        with db.batch() as batch:
            assert len(batch.select_due(10)) == 10
        assert not db.lanes_index_ready(LANES), "not the function this drain creates"
    finally:
        db.close()


def test_the_printed_migration_builds_the_lanes_index_and_function() -> None:
    script = migrations.script(NAMES, wake_slots=8, lanes=LANES)
    assert f'CREATE INDEX CONCURRENTLY IF NOT EXISTS "{INDEX}"' in script
    assert f'CREATE OR REPLACE FUNCTION "public"."{FUNCTION}"' in script
    assert "lanes" not in migrations.script(NAMES)[-400:]


def test_the_lanes_function_s_plan_is_read_back_as_json(conn: psycopg.Connection[object]) -> None:
    _build(conn)
    with conn.transaction(force_rollback=True):
        conn.execute(migrations.statement("lanes_plan_settings", NAMES))
        row = conn.execute(migrations.lanes_statement("lanes_plan", NAMES, LANES)).fetchone()
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    assert plan[0]["Plan"]["Node Type"] == "Limit"


def test_drain_check_warns_until_drain_migrate_builds_the_lanes_index(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    """`drain check` with lanes = 8 on a table migrated without them: one warning line naming the
    index, the function and what to run; after `drain migrate` with the same config, none."""
    path = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rq(redis_db)}, lanes=LANES
    )
    done = processes.drain_cli("check", "--config", str(path), dsn=database)
    warnings = [line for line in (done.stdout + done.stderr).splitlines() if "lanes index" in line]
    assert len(warnings) == 1, done.stdout + done.stderr
    assert INDEX in warnings[0] and FUNCTION in warnings[0] and "drain migrate" in warnings[0]
    migrated = processes.drain_cli("migrate", "--config", str(path), dsn=database)
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    done = processes.drain_cli("check", "--config", str(path), dsn=database)
    assert "lanes index" not in done.stdout + done.stderr, done.stdout + done.stderr


def test_a_role_that_may_not_execute_the_lanes_function_walks(
    conn: psycopg.Connection[object], database: str
) -> None:
    """The drain's least-privilege role (deploy/database/drain-role.sql) runs the lanes function by
    PUBLIC's default EXECUTE; where that is revoked the index does not serve it (it walks)."""
    from tests.deploy.test_database_role import grants_for

    _build(conn)
    role = f"drain_role_{uuid.uuid4().hex[:10]}"
    conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(role)))
    try:
        conn.execute(grants_for(role).encode())
        as_role = psycopg.conninfo.make_conninfo(database, user=role)
        db = store.Store(config.Settings(dsn=as_role, lanes=LANES))
        try:
            assert db.lanes_index_ready(LANES)
            conn.execute(
                f"REVOKE EXECUTE ON FUNCTION {FUNCTION}(int[], bigint, text[], bigint[]) FROM PUBLIC"
            )
            assert not db.lanes_index_ready(LANES)
        finally:
            db.close()
    finally:
        conn.execute(pgsql.SQL("DROP OWNED BY {}").format(pgsql.Identifier(role)))
        conn.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))
