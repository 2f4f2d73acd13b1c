"""The SQL files: the set of named queries is pinned, identifiers are always quoted."""

from __future__ import annotations

from drain import leadership, sql, store

EXPECTED_QUERIES = {
    "bury",
    "dead_filter",
    "dead_list",
    "dead_purge",
    "dead_retry",
    "delete_ids",
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
    "schedule_ticks",
    "select_due",
    "session_timeouts",
    "set_timeouts",
    "status",
    "table_exists",
    "try_lock",
    "unlock",
    "wake_arm",
    "wake_disarm",
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
    classid, objid = store.split_key(key)
    assert (classid << 32 | objid) == key & 0xFFFFFFFFFFFFFFFF
