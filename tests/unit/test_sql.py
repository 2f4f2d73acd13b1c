"""The SQL files: the set of named queries is pinned, identifiers are always quoted, every name
derived from the table's fits PostgreSQL's 63 bytes or the configuration is refused, and the
schema's upgrade steps are numbered in order. (That the steps rebuild schema.sql is checked on a
real database: tests/store/test_schema_versions.py.)"""

from __future__ import annotations

import re
from importlib import resources

import pytest

from drain import config, errors
from drain import names as db_names
from drain.relay import leadership
from drain.store import connection, migrations, sql, writes

EXPECTED_QUERIES = {
    "bury",
    "can_insert",
    "drains",
    "set_application_name",
    "dead_filter",
    "dead_agreed",
    "dead_matching",
    "dead_scan_bound",
    "dead_candidates",
    "dead_any_case",
    "dead_extent",
    "dead_page",
    "queue_backlog",
    "may_act",
    "limit_statements",
    "estimates",
    "dead_ids",
    "dead_list",
    "dead_purge",
    "dead_retry",
    "delete_ids",
    "due_rows",
    "due_now",
    "due_now_lanes",
    "present_ids",
    "park",
    "parked_count",
    "park_in_place",
    "not_parked_in_place",
    "lane_of",
    "in_lanes",
    "key_free",
    "insert_job",
    "insert_jobs",
    "leader",
    "lock_held",
    "record_failures",
    "seconds_until_due",
    "schedule_advance",
    "schedule_list",
    "schedule_now",
    "schedule_stage",
    "schedule_tick_rows",
    "schedule_ticks",
    "select_due",
    "session_timeouts",
    "settle_check",
    "held_ids",
    "fire_deferred",
    "limit_lock_wait",
    "lock_for_writes",
    "lock_dead_for_writes",
    "probe_row",
    "probe_row_id",
    "set_timeouts",
    "status",
    "blocked",
    "table_exists",
    "try_lock",
    "unlock",
    "try_lock_shared",
    "unlock_shared",
    "lane_lock",
    "lane_unlock",
    "lane_holders",
    "lane_sessions",
    "lane_backlog",
    "lanes_held",
    "listen",
    "ping",
    "wake_arm",
    "wake_disarm",
    "wake_due",
    "anything_due",
    "wake_trigger_enabled",
}


def test_query_names_are_pinned() -> None:
    assert set(sql.raw_queries()) == EXPECTED_QUERIES


def test_identifiers_are_quoted() -> None:
    names = sql.Names("My Schema", 'we"ird')
    text = sql.query("delete_ids", names).as_string(None)
    assert '"My Schema"."we""ird"' in text
    schema = sql.schema(names).as_string(None)
    assert '"we""ird_dead"' in schema


def test_lock_key_is_stable_and_per_table() -> None:
    key = leadership.lock_key("public", "staged_jobs")
    # pinned: a drain of another version must contend for the very same lock
    assert key == -7612345459516739447
    assert key != leadership.lock_key("public", "other_jobs")
    assert -(2**63) <= key < 2**63
    classid, objid = connection.split_key(key)
    assert (classid << 32 | objid) == key & 0xFFFFFFFFFFFFFFFF


MIGRATION_STATEMENTS = {
    "lock_timeout",
    "no_statement_timeout",
    "state",
    "version",
    "versions_table",
    "record_version",
    "fresh_guard",
    "upgrade_guard",
    "validate",
    "validate_result",
    "not_valid",
    "index_invalid",
    "drop_index",
    "lanes_index",
    "lanes_function",
    "lanes_function_body",
    "lanes_ready",
    "lanes_plan_settings",
    "lanes_plan",
    "lock",
    "wait_lock",
    "unlock",
}


def test_migration_statement_names_are_pinned() -> None:
    assert set(sql.raw_queries("migrations.sql")) == MIGRATION_STATEMENTS


def sql_files() -> list[str]:
    return [path.name for path in resources.files(sql).iterdir() if path.name.endswith(".sql")]


def test_every_identifier_the_sql_uses_is_a_checked_name() -> None:
    """A new derived name (an index, a table) must be in sql.CREATED_NAMES, whose lengths
    sql.name_problems checks: else it could pass 63 bytes unnoticed."""
    identifiers = set(sql.Names("public", "t").identifiers())
    used = set()
    for filename in sql_files():
        text = resources.files(sql).joinpath(filename).read_text()
        used |= set(re.findall(r"(?<!\{)\{([a-z_]+)\}(?!\})", text))
    literals = set(sql.Names("public", "t").literals())
    extra = {
        "dead_filter",
        "dead_agreed",
        "due_rows",
        "not_parked_in_place",
        "lane_of",
        "in_lanes",
        "key_free",
        "version",
    }
    extra |= {"description"}
    extra |= {"drain_version", "lock_timeout"}
    extra |= {"qualified_index", "index"}
    # the lanes index and function of a count (migrations.lanes_statement, sql.query's lane_count):
    # names.lanes_index / lanes_function, whose longest name_problems checks
    extra |= {"due_now", "function", "qualified_function", "lanes_function", "body"}
    extra |= {"channel"}  # LISTEN's: drain_wake_<16 hex digits> (wake_arm), never longer
    extra |= {"wake_slots"}  # an integer Literal (sql.functions)
    assert used - literals - extra <= identifiers
    assert set(sql.CREATED_NAMES) <= set(db_names.derived_names("t"))


def test_a_table_whose_derived_names_pass_63_bytes_is_refused_naming_the_key() -> None:
    longest = max(len(name) - 1 for name in db_names.derived_names("t").values())  # suffix length
    fits = "t" * (db_names.MAX_IDENTIFIER_BYTES - longest)
    assert all(len(name.encode()) <= 63 for name in sql.Names("public", fits).derived().values())
    assert config.parse({"table": fits}).table == fits
    too_long = fits + "x"  # its dead letters' dead_id index would be 64 bytes: truncated, on main
    with pytest.raises(errors.ConfigError) as refused:
        config.parse({"table": too_long})
    (line,) = refused.value.problems
    assert line.startswith("table: ") and "64 bytes" in line and f"at most {len(fits)} bytes" in line
    with pytest.raises(errors.ConfigError, match=r"^table: "):
        sql.Names("public", too_long)


def test_a_schema_over_63_bytes_is_refused_naming_the_key() -> None:
    with pytest.raises(errors.ConfigError) as refused:
        config.parse({"schema": "s" * 64})
    assert refused.value.problems == [
        "schema: 64 bytes, and PostgreSQL keeps 63 of an identifier (it would truncate it without a word)"
    ]
    assert sql.Names("s" * 63, "staged_jobs").schema == "s" * 63
    with pytest.raises(errors.ConfigError, match=r"^table: "):
        sql.Names("public", "é" * 24)  # 48 bytes: bytes count, not characters


def test_upgrade_steps_are_numbered_from_2_and_every_block_says_how_it_runs() -> None:
    versions = list(migrations.UPGRADES)
    assert versions == list(range(2, 2 + len(versions)))
    assert versions[-1] == migrations.LATEST_VERSION
    names = sql.Names("public", "staged_jobs")
    for version in migrations.UPGRADES:
        found = migrations.blocks(version, names)
        assert found, version
        for block in found:
            assert block.kind in migrations.KINDS
            if block.kind == "concurrently":
                assert block.index in names.derived()
                assert "CONCURRENTLY" in block.statement.as_string(None)


def test_the_printed_sql_spells_out_transactions_and_refuses_a_wrong_start() -> None:
    names = sql.Names("public", "staged_jobs")
    fresh = migrations.script(names)
    assert fresh.count("BEGIN;") == fresh.count("COMMIT;") == 3
    assert "CONCURRENTLY" not in fresh and "already exists at an older schema version" in fresh
    upgrade = migrations.script(names, 1)
    assert "SET LOCAL lock_timeout = '100ms';" in upgrade and "VALIDATE CONSTRAINT" in upgrade
    assert upgrade.index("drain_job_check_v1(") < upgrade.index("ADD CONSTRAINT drain_job_check")
    index = upgrade.index("CREATE INDEX CONCURRENTLY")
    assert upgrade.rfind("COMMIT;", 0, index) > upgrade.rfind("BEGIN;", 0, index)  # outside one
    assert "{" not in upgrade.replace("{}", "")  # every placeholder filled
    for wrong in (0, migrations.LATEST_VERSION + 1):
        with pytest.raises(errors.ConfigError, match=r"^--from: "):
            migrations.script(names, wrong)


def test_the_rows_parked_in_place_that_selects_skip_carry_the_drains_prefix() -> None:
    fragment = sql.raw_queries()["not_parked_in_place"]
    prefix = writes.PARKED_IN_PLACE_PREFIX
    assert f"left(last_error, {len(prefix)}) <> '{prefix}'" in fragment
    for name in ("due_rows", "status", "blocked", "anything_due", "parked_count"):
        assert "{not_parked_in_place}" in sql.raw_queries()[name], name


@pytest.mark.parametrize(
    ("key", "name"), [("table", "jobs%s"), ("table", "a%%b"), ("schema", "s%"), ("table", "t\x00")]
)
def test_a_name_with_a_percent_sign_is_refused_naming_the_key(key: str, name: str) -> None:
    """Red team 33: psycopg reads % in a statement's text as a placeholder, and the names are in
    that text: a % failed every statement (or %% named another table). Refused at the config."""
    with pytest.raises(errors.ConfigError) as refused:
        config.parse({key: name})
    assert any(line.startswith(f"{key}: a name with '%'") for line in refused.value.problems)


def test_the_lanes_index_and_function_of_the_longest_table_name_fit_63_bytes() -> None:
    """Their names grow with the lane count (MAX_LANES the longest): a table short enough for
    every derived name is short enough for them."""
    longest = max(len(name) - 1 for name in db_names.derived_names("t").values())
    fits = "t" * (db_names.MAX_IDENTIFIER_BYTES - longest)
    assert not db_names.name_problems("public", fits)
    for lanes in (2, 8, config.MAX_LANES):
        assert len(db_names.lanes_index(fits, lanes).encode()) <= db_names.MAX_IDENTIFIER_BYTES
        assert len(db_names.lanes_function(fits, lanes).encode()) <= db_names.MAX_IDENTIFIER_BYTES
