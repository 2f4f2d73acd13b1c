"""Red team 39, second round: the lanes index and its function (`drain migrate` with lanes = N;
queries.sql due_now_lanes, migrations.sql lanes_*), against the guarantees.

Each test runs on a fresh migrated database; drains run in-process (tests/relay/test_lanes.py's
helpers, a ManualClock, the in-memory adapter as broker) or the select is run on its own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from drain import config, names, testing
from drain.relay import lanes as lanes_mod
from drain.store import migrations, reading, sql
from drain.store import session as store
from tests.conftest import ManualClock
from tests.relay.test_lanes import LANES, drains, remaining, rounds, shares, stage
from tests.support import lanes as lanes_support
from tests.support import roles

NAMES = sql.Names("public", "staged_jobs")
FUNCTION = names.lanes_function("staged_jobs", LANES)


def _build(dsn: str, lanes: int = LANES) -> None:
    lanes_support.build_lanes_index(dsn, lanes)


def _reader(led: list[int]) -> reading.Reader:
    return lanes_support.lane_reader(LANES, led)


def _params(reader: reading.Reader, limit: int) -> dict[str, object]:
    return {"paused": [], "exclude": "{}", **reader.params(limit, config.BATCH_MAX_BYTES)}


def _lane(conn: psycopg.Connection[Any], row_id: int) -> int:
    row = conn.execute(
        "SELECT mod(hashtext(coalesce(ordering_key, job_id::text)) & 2147483647, %s) "
        "FROM staged_jobs WHERE id = %s",
        (LANES, row_id),
    ).fetchone()
    assert row is not None
    return int(row[0])


# --- F1: a drain role without EXECUTE on the lanes function ---------------------------------


@pytest.mark.parametrize("execute", ["granted", "revoked"])
def test_redteam39i_a_drain_role_without_execute_on_the_lanes_function_keeps_forwarding(
    settings: config.Settings,
    database: str,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
    execute: str,
) -> None:
    """A database that revokes EXECUTE on new functions from PUBLIC (ALTER DEFAULT PRIVILEGES,
    a common hardening; docs/operations/database.md only asks to grant drain_job_check_v1 then),
    `drain migrate` with lanes = 8 as the owner, four members of 2 lanes each as the documented
    drain role. 20,000 rows, batch_size 50: 40 rounds forward 8,000 (4 x 50 a round), through the
    index where the role may run its function and walking where it may not, and no member ever
    steps down.

    Measured on the first version (the check looked for the function's name only, and only a
    dropped function sent a member back to the walk), two members of 4 lanes then reading
    through the index: revoked, 1,350 forwarded in 40 rounds, 27 'lost leadership: permission
    denied for function staged_jobs_lanes8_due', lanes churning between the two members."""
    if execute == "revoked":
        roles.execute(database, "ALTER DEFAULT PRIVILEGES REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC")
    _build(database)
    stage(database, 20_000, keys=0)
    roles.execute(database, "ANALYZE staged_jobs")
    with roles.drain_role(database) as dsn:
        tuned = dataclasses.replace(settings, dsn=dsn)
        checker = store.Store(dataclasses.replace(tuned, lanes=LANES))
        try:
            said_ready = checker.lanes_index_ready(LANES)
        finally:
            checker.close()
        pairs = list(drains(tuned, 4, clock))
        relays = [r for r, _ in pairs]
        try:
            with caplog.at_level(logging.WARNING, logger="drain.relay.loop"):
                rounds(relays, clock, 40)
            led = shares(relays)
            indexed = [each.store.reader.indexed_lanes() for each in relays]
        finally:
            for each in relays:
                each.shutdown()
    forwarded = sum(len(adapter.published) for _, adapter in pairs)
    denied = [r for r in caplog.records if "permission denied" in r.getMessage()]
    assert said_ready is (execute == "granted"), "the check says whether the index serves this role"
    assert indexed == [LANES if execute == "granted" else None] * 4
    assert not denied, f"{len(denied)} step-downs: {denied[0].getMessage()}"
    assert sorted(len(s) for s in led) == [2, 2, 2, 2]
    assert forwarded >= 7_800, forwarded
    assert remaining(database) == 20_000 - forwarded


# --- F2: two `drain migrate` at once ---------------------------------------------------------


def _waiting_on_advisory(conn: psycopg.Connection[Any], count: int) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'advisory' "
        "AND datname = current_database()"
    ).fetchone()
    return row is not None and int(row[0]) >= count


def test_redteam39i_two_migrates_with_lanes_at_once_both_succeed(database: str) -> None:
    """Two tables of one database, each migrated with lanes = 8 at the same moment (two apps'
    migrate Jobs, one deploy): the second waits for the first's migrate lock, and both end
    migrated, as they do without lanes. Made deterministic: the test holds the migrate lock
    until both wait for it. Measured: the one to take the lock second fails with 'deadlock
    detected' (its pg_advisory_lock waits for the first, whose CREATE INDEX CONCURRENTLY waits
    for its snapshot) after deadlock_timeout (1 s); without lanes both succeed."""
    store.Store(config.Settings(dsn=database, table="other_jobs")).migrate()
    outcomes: dict[str, object] = {}

    def migrate(table: str) -> None:
        try:
            outcomes[table] = store.Store(config.Settings(dsn=database, table=table, lanes=LANES)).migrate()
        except Exception as exc:  # the outcome is the test's subject
            outcomes[table] = exc

    with psycopg.connect(database, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtext('drain:migrate'))")
        threads = [threading.Thread(target=migrate, args=(t,)) for t in ("staged_jobs", "other_jobs")]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while not _waiting_on_advisory(holder, 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        holder.execute("SELECT pg_advisory_unlock(hashtext('drain:migrate'))")
        for thread in threads:
            thread.join(60)
    failed = {table: f"{type(o).__name__}: {o}" for table, o in outcomes.items() if isinstance(o, Exception)}
    assert len(outcomes) == 2
    assert not failed, failed


# --- F3: a lanes function replaced by another body -------------------------------------------


def test_redteam39i_a_replaced_lanes_function_does_not_make_a_member_take_rows_it_must_not(
    database: str,
) -> None:
    """The function of the right name and signature but another body (hand-edited, restored
    from another environment's dump): here one that hands back every row's id. The check says
    the index serves; the member leading lanes {0, 1} then selects rows of lanes it does not
    lead (another member's: a second publisher of the same rows), a row due tomorrow, a paused
    backend's row and a row in flight. Measured on the first version: all of them taken. Now the
    check compares the function's body, and the select tests every id it is handed again."""
    with psycopg.connect(database, autocommit=True) as conn:
        _build(database)
        conn.execute(
            "INSERT INTO staged_jobs (job_name, backend, run_at) SELECT 'x', "
            "CASE WHEN i % 10 = 0 THEN 'paused' ELSE 'default' END, "
            "CASE WHEN i % 10 = 1 THEN now() + interval '1 day' END FROM generate_series(1, 2000) AS i"
        )
        conn.execute("ANALYZE staged_jobs")
        conn.execute(
            f"CREATE OR REPLACE FUNCTION {FUNCTION}(int[], bigint, text[], bigint[]) RETURNS bigint[] "
            "LANGUAGE sql STABLE AS $$ SELECT array_agg(id ORDER BY id) FROM (SELECT id FROM staged_jobs "
            "ORDER BY id LIMIT $2) AS f $$"
        )
        db = store.Store(config.Settings(dsn=database, lanes=LANES))
        try:
            assert not db.lanes_index_ready(LANES), "not the function drain creates"
        finally:
            db.close()
        reader = _reader([0, 1])
        params = _params(reader, 50)
        params["paused"], params["exclude"] = ["paused"], "{3}"
        with conn.transaction(force_rollback=True):
            taken = [row[0] for row in conn.execute(sql.query("select_due", NAMES, lane_count=LANES), params)]
        wrong = {
            "other lanes": [i for i in taken if _lane(conn, i) not in (0, 1)],
            "future": conn.execute(
                "SELECT array_agg(id) FROM staged_jobs WHERE id = ANY(%s) AND run_at > now()", (taken,)
            ).fetchone(),
            "paused": conn.execute(
                "SELECT array_agg(id) FROM staged_jobs WHERE id = ANY(%s) AND backend = 'paused'", (taken,)
            ).fetchone(),
            "in flight": [i for i in taken if i == 3],
        }
    assert taken
    assert wrong == {"other lanes": [], "future": (None,), "paused": (None,), "in flight": []}, wrong


# --- F4: rows locked and not taken (both ways of reading) --------------------------------------


@pytest.mark.parametrize("reading_way", ["walk", "lanes index"])
@pytest.mark.xfail(
    strict=True,
    reason="due_rows locks each branch's limit (due_now's and fell_due's FOR UPDATE SKIP LOCKED) "
    "and the outer ORDER BY id LIMIT keeps limit of them: up to limit rows stay locked by the "
    "batch without being taken (an app's UPDATE waits for the batch; one changed since the "
    "snapshot fails the select with 40001). Not new in 1d33247, which says it 'locks only the "
    "rows it takes'",
)
def test_redteam39i_a_select_locks_no_row_it_does_not_take(database: str, reading_way: str) -> None:
    """80 rows that fell due (run_at passed) with the lowest ids, then 80 due now; a select of
    limit 10 by a member leading lanes {0..3} of 8 (through the walk, or the index): it takes the
    ten lowest due ids of its lanes (fell due); an app then locks (NOWAIT) every other row of
    those lanes. Measured: the 10 first due-now rows of its lanes, not taken, are locked too
    (55P03 for the app), both ways."""
    led = [0, 1, 2, 3]
    with psycopg.connect(database, autocommit=True) as conn:
        _build(database)
        conn.execute(
            "INSERT INTO staged_jobs (job_name, run_at) SELECT 'x', now() - interval '1 minute' "
            "FROM generate_series(1, 80)"
        )
        conn.execute("INSERT INTO staged_jobs (job_name) SELECT 'x' FROM generate_series(1, 80)")
        conn.execute("ANALYZE staged_jobs")
        mine = [
            row[0]
            for row in conn.execute("SELECT id FROM staged_jobs ORDER BY id").fetchall()
            if _lane(conn, row[0]) in led
        ]
        reader = _reader(led)
        params = _params(reader, 10)
        lane_count = LANES if reading_way == "lanes index" else None
        with conn.transaction(force_rollback=True):
            taken = [
                row[0] for row in conn.execute(sql.query("select_due", NAMES, lane_count=lane_count), params)
            ]
            others = [i for i in mine if i not in taken]
            blocked = []
            with psycopg.connect(database, autocommit=True) as app:
                for row_id in others:
                    try:
                        app.execute("SELECT id FROM staged_jobs WHERE id = %s FOR UPDATE NOWAIT", (row_id,))
                    except psycopg.errors.LockNotAvailable:
                        blocked.append(row_id)
    assert taken == mine[:10]
    assert blocked == [], f"{len(blocked)} rows locked, not taken: {blocked}"


# --- F5: the readiness check on a small, never analyzed table -----------------------------------


def test_redteam39i_the_index_migrate_just_built_is_found_on_a_small_table(database: str) -> None:
    """`drain migrate` with lanes = 8 on a drained table (the index built while it is empty),
    then 400 rows staged and no ANALYZE yet: the index and function are there and valid, and
    a member reading through them takes the same rows. Measured: lanes_index_ready False (the
    plan reads staged_jobs_due_idx with the lane as a filter), so drain check warns to run
    drain migrate, which changes nothing."""
    _build(database)
    stage(database, 400, keys=0)
    db = store.Store(config.Settings(dsn=database, lanes=LANES))
    try:
        assert db.lanes_index_ready(LANES)
    finally:
        db.close()


# --- F6: a table name holding the function's dollar-quote tag ------------------------------------


def test_redteam39i_a_table_named_with_a_dollar_tag_migrates_with_lanes(database: str) -> None:
    """name_problems refuses '%' and NUL only; a table "jobs$lanes$x" migrates without lanes
    (measured), and with lanes = 8 fails after the table was made: SyntaxError at the function."""
    table = "jobs$lanes$x"
    store.Store(config.Settings(dsn=database, table=table)).migrate()
    store.Store(config.Settings(dsn=database, table=table, lanes=LANES)).migrate()
    with psycopg.connect(database, autocommit=True) as conn:
        row = conn.execute(
            "SELECT to_regprocedure(%s)",
            (f'"public"."{names.lanes_function(table, LANES)}"(int[], bigint, text[], bigint[])',),
        ).fetchone()
    assert row is not None and row[0] is not None


# --- Attempts that held (kept as regression tests) ----------------------------------------------


def test_redteam39i_members_joining_and_leaving_with_the_index_lose_nothing_and_keep_key_order(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """Four members over 8 lanes reading through the index (ANALYZEd backlog), keyed and unkeyed
    rows staged every round, and every third round one member shut down and a fresh one started
    (lanes handed over with the index in use). One broker: every row exactly once, per-key order."""
    import random

    rng = random.Random(39)
    _build(database)
    broker = testing.MemoryAdapter()
    staged = 0

    def stage_more(count: int) -> None:
        nonlocal staged
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO staged_jobs (job_name, job_args, ordering_key) "
                "SELECT 'job', jsonb_build_array(i), CASE WHEN i %% 3 > 0 THEN 'k' || (i %% 37) END "
                "FROM generate_series(%s, %s - 1) AS i",
                (staged, staged + count),
            )
        staged += count

    stage_more(3_000)
    roles.execute(database, "ANALYZE staged_jobs")
    relays = [r for r, _ in drains(settings, 4, clock, adapter=broker)]
    used = 0
    try:
        for n in range(60):
            if n % 3 == 2:
                leaving = relays.pop(rng.randrange(len(relays)))
                leaving.shutdown()
                relays.extend(r for r, _ in drains(settings, 1, clock, adapter=broker))
            if n < 40:
                stage_more(60)
            rounds(relays, clock, 1)
            clock.advance(lanes_mod.INDEX_LOOK_EVERY_S / 10)
            used += sum(1 for r in relays if r.store.reader.indexed_lanes() == LANES)
        for _ in range(40):
            if remaining(database) == 0:
                break
            rounds(relays, clock, 1)
    finally:
        for each in relays:
            each.shutdown()
    numbers = [job.args[0] for job in broker.published]
    print(f"member-rounds through the index: {used}; staged {staged}; published {len(numbers)}")
    assert used > 0, "members read through the index"
    assert remaining(database) == 0
    assert sorted(numbers) == list(range(staged)), (len(numbers), len(set(numbers)), staged)
    by_key: dict[str | None, list[int]] = {}
    for job in broker.published:
        by_key.setdefault(job.ordering_key, []).append(job.args[0])
    for key, seen in by_key.items():
        if key is not None:
            assert seen == sorted(seen), f"{key} out of order"


def test_redteam39i_an_index_left_invalid_by_a_cancelled_build_is_not_used_and_migrate_rebuilds_it(
    database: str,
) -> None:
    """CREATE INDEX CONCURRENTLY of the lanes index cancelled while it waits for an app's open
    transaction: the index stays, INVALID. The check says it does not serve (the walk); the next
    `drain migrate` with lanes drops and builds it again."""
    stage(database, 5_000, keys=0)
    with psycopg.connect(database) as app:
        app.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        app.execute("SELECT count(*) FROM staged_jobs")  # a snapshot the build must wait for
        with psycopg.connect(database, autocommit=True) as builder:
            pid = builder.info.backend_pid

            def cancel() -> None:
                time.sleep(1.0)
                with psycopg.connect(database, autocommit=True) as other:
                    other.execute("SELECT pg_cancel_backend(%s)", (pid,))

            canceller = threading.Thread(target=cancel)
            canceller.start()
            with pytest.raises(psycopg.errors.QueryCanceled):
                builder.execute(migrations.lanes_statement("lanes_index", NAMES, LANES))
            canceller.join()
        app.rollback()
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(migrations.lanes_statement("lanes_function", NAMES, LANES))
        conn.execute("ANALYZE staged_jobs")
        invalid = conn.execute(
            migrations.statement("index_invalid", NAMES, index=names.lanes_index("staged_jobs", LANES))
        ).fetchone()
    db = store.Store(config.Settings(dsn=database, lanes=LANES))
    try:
        assert invalid == (True,)
        assert not db.lanes_index_ready(LANES), "an invalid index does not serve"
        db.migrate()
        assert db.lanes_index_ready(LANES), "migrate dropped and built it again"
    finally:
        db.close()


def test_redteam39i_odd_names_at_the_length_limit_get_a_serving_lanes_index(database: str) -> None:
    """Schema "My Schema", a 46-byte table name with uppercase and a space (the longest
    name_problems lets through), lanes = 256 (the longest derived names): migrate builds the
    index and function, the check finds them, and a member of lanes {0, 1} takes the rows the
    walk takes."""
    schema, table = "My Schema", "Jobs Q " + "x" * 39
    assert len(table.encode()) == 46
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE SCHEMA {}").format(pgsql.Identifier(schema)))
    settings = config.Settings(dsn=database, schema=schema, table=table, lanes=256)
    db = store.Store(settings)
    try:
        db.migrate()
        qualified = pgsql.SQL("{}.{}").format(pgsql.Identifier(schema), pgsql.Identifier(table))
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                pgsql.SQL("INSERT INTO {} (job_name) SELECT 'x' FROM generate_series(1, 20000)").format(
                    qualified
                )
            )
            conn.execute(pgsql.SQL("ANALYZE {}").format(qualified))
        assert db.lanes_index_ready(256)
        reader = db.reader
        reader.lane_count, reader.led_count, reader.led_lanes = 256, 2, "{0,1}"
        reader.other_lanes = "{" + ",".join(str(n) for n in range(2, 256)) + "}"
        reader.lanes_indexed = True
        taken = {}
        for indexed in (True, False):
            reader.lanes_indexed = indexed
            with db.batch() as batch:
                taken[indexed] = [job.id for job in batch.select_due(20)]
        assert taken[True] == taken[False] and len(taken[True]) == 20
    finally:
        db.close()


# --- F7: at most half the lanes is not where the index reads less ------------------------------


def _index_reads(conn: psycopg.Connection[Any]) -> dict[str, int]:
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return {
        str(name): int(read)
        for name, read in conn.execute(
            "SELECT indexrelname, coalesce(idx_tup_read, 0) FROM pg_stat_user_indexes "
            "WHERE relname = 'staged_jobs'"
        ).fetchall()
    }


@pytest.mark.slow
def test_redteam39i_with_128_of_256_lanes_led_a_member_walks_which_reads_less(database: str) -> None:
    """lanes = 256, two members (128 lanes each), 100,000 due rows spread over the lanes,
    ANALYZEd, a select of the default batch_size (500, window 1,000): the index entries the
    select reads through the lanes index against walking the due index. The first rule (through
    the index while leading at most half the lanes) read through it here; measured (load 4-5,
    200,000 rows): 139 ms a select through the index, 17 ms walking (lanes = 64 with 32 led: 47.5
    against 12.3 ms). With k x k <= 2 N the member walks."""

    lanes, led = 256, list(range(0, 256, 2))
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO staged_jobs (job_name) SELECT 'x' FROM generate_series(1, 100000)")
        migrations.build_lanes_index(migrations.Autocommit(conn), NAMES, lanes)
        conn.execute("ANALYZE staged_jobs")
        reader = reading.Reader(config.BATCH_MAX_BYTES)
        reader.lane_count = lanes
        reader.other_lanes = "{" + ",".join(str(n) for n in range(lanes) if n not in led) + "}"
        reader.led_lanes = "{" + ",".join(map(str, led)) + "}"
        reader.led_count, reader.lanes_indexed = len(led), True
        assert reader.indexed_lanes() is None, "128 x 128 > 2 x 256: the walk"
        params = _params(reader, 500)
        reads: dict[str, int] = {}
        taken: dict[str, list[int]] = {}
        for way, lane_count in (("index", lanes), ("walk", None)):
            statement = sql.query("select_due", NAMES, lane_count=lane_count)
            before = _index_reads(conn)
            with conn.transaction(force_rollback=True):
                taken[way] = [row[0] for row in conn.execute(statement, params)]
            after = _index_reads(conn)
            reads[way] = sum(after.values()) - sum(before.values())
    assert taken["index"] == taken["walk"] and len(taken["index"]) == 500
    assert reads["index"] > 4 * reads["walk"], reads


def test_redteam39i_an_app_trigger_on_the_drain_s_delete_sees_the_session_s_planner_settings(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """An app's AFTER DELETE trigger records enable_seqscan, enable_bitmapscan and jit as each of
    the drain's settlements runs it, while four members (2 lanes of 8 each) read through the lanes
    function (whose SET clauses turn them off): every row the trigger saw, the session's values."""
    _build(database)
    roles.execute(
        database,
        "CREATE TABLE seen (seqscan text, bitmapscan text, jit text); "
        "CREATE FUNCTION record_settings() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "INSERT INTO seen VALUES (current_setting('enable_seqscan'), current_setting('enable_bitmapscan'), "
        "current_setting('jit')); RETURN OLD; END $$; "
        "CREATE TRIGGER record_settings AFTER DELETE ON staged_jobs "
        "FOR EACH ROW EXECUTE FUNCTION record_settings()",
    )
    stage(database, 20_000, keys=0)
    roles.execute(database, "ANALYZE staged_jobs")
    pairs = list(drains(settings, 4, clock))
    relays = [r for r, _ in pairs]
    try:
        rounds(relays, clock, 6)
        indexed = [r.store.reader.indexed_lanes() for r in relays]
    finally:
        for each in relays:
            each.shutdown()
    with psycopg.connect(database, autocommit=True) as conn:
        seen = conn.execute("SELECT seqscan, bitmapscan, jit, count(*) FROM seen GROUP BY 1, 2, 3").fetchall()
    assert indexed == [LANES] * 4
    assert [row[:3] for row in seen] == [("on", "on", "on")], seen
    assert seen[0][3] == sum(len(adapter.published) for _, adapter in pairs)


@pytest.mark.parametrize("reading_way", ["walk", "lanes index"])
@pytest.mark.xfail(
    strict=True,
    reason="as test_redteam39i_a_select_locks_no_row_it_does_not_take: the due-now branch locks "
    "its limit before the outer LIMIT drops them, so a row changed since the batch's snapshot "
    "that the select would never take fails it with 40001 (not new in 1d33247)",
)
def test_redteam39i_an_app_changing_a_row_the_select_does_not_take_does_not_fail_it(
    database: str, reading_way: str
) -> None:
    """Rows that fell due with the lowest ids, then rows due now (lanes {0..3} of 8 led). The
    batch's REPEATABLE READ snapshot is taken; an app then updates (and commits) the lowest
    due-now row of those lanes, one the select of limit 10 does not take (the ten fell-due rows
    come first). Measured: the select fails with SerializationFailure (40001)."""
    led = [0, 1, 2, 3]
    with psycopg.connect(database, autocommit=True) as conn:
        _build(database)
        conn.execute(
            "INSERT INTO staged_jobs (job_name, run_at) SELECT 'x', now() - interval '1 minute' "
            "FROM generate_series(1, 80)"
        )
        conn.execute("INSERT INTO staged_jobs (job_name) SELECT 'x' FROM generate_series(1, 80)")
        conn.execute("ANALYZE staged_jobs")
        due_now = [
            row[0]
            for row in conn.execute("SELECT id FROM staged_jobs WHERE run_at IS NULL ORDER BY id").fetchall()
            if _lane(conn, row[0]) in led
        ]
    params = _params(_reader(led), 10)
    lane_count = LANES if reading_way == "lanes index" else None
    with psycopg.connect(database) as batch:
        batch.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        batch.execute("SELECT 1 FROM staged_jobs LIMIT 1")  # the snapshot
        roles.execute(database, f"UPDATE staged_jobs SET attempts = attempts WHERE id = {due_now[0]}")
        taken = [
            row[0] for row in batch.execute(sql.query("select_due", NAMES, lane_count=lane_count), params)
        ]
        batch.rollback()
    assert due_now[0] not in taken and len(taken) == 10


def test_redteam39i_migrate_with_another_lane_count_while_members_read_through_the_index(
    settings: config.Settings, database: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Four members of 8 lanes read through the lanes8 index while `drain migrate` with lanes = 4
    runs beside them (its CREATE INDEX CONCURRENTLY waits for their batches): it ends, the
    members never step down and keep reading through theirs, and both counts' index and function
    stay (drains of the old count may still run)."""
    _build(database)
    stage(database, 20_000, keys=0)
    roles.execute(database, "ANALYZE staged_jobs")
    pairs = list(drains(settings, 4, clock))
    relays = [r for r, _ in pairs]
    outcome: list[object] = []

    def migrate() -> None:
        try:
            outcome.append(store.Store(dataclasses.replace(settings, lanes=4)).migrate())
        except Exception as exc:  # the outcome is the test's subject
            outcome.append(exc)

    migrating = threading.Thread(target=migrate)
    try:
        rounds(relays, clock, 2)
        with caplog.at_level(logging.WARNING, logger="drain.relay.loop"):
            migrating.start()
            for _ in range(200):
                rounds(relays, clock, 1)
                if not migrating.is_alive():
                    break
            migrating.join(30)
            rounds(relays, clock, 3)
        indexed = [r.store.reader.indexed_lanes() for r in relays]
    finally:
        for each in relays:
            each.shutdown()
    assert outcome and not isinstance(outcome[0], Exception), outcome
    assert not [r for r in caplog.records if "lost leadership" in r.getMessage()]
    assert indexed == [LANES] * 4
    checker = store.Store(dataclasses.replace(settings, lanes=4))
    try:
        assert checker.lanes_index_ready(4) and checker.lanes_index_ready(LANES)
    finally:
        checker.close()
    forwarded = sum(len(adapter.published) for _, adapter in pairs)
    assert remaining(database) == 20_000 - forwarded
