"""The names drain gives what it creates in the database, derived from the table's name, and
whether they fit PostgreSQL's identifiers. Pure values: the settings check them, the store's
statements use them."""

from __future__ import annotations

from drain.models import DEFAULT_TABLE

STAGE_FUNCTION = "drain_stage_v1"
STAGE_FUNCTION_V2 = "drain_stage_v2"
MAX_IDENTIFIER_BYTES = 63  # PostgreSQL's NAMEDATALEN - 1: longer identifiers are truncated

__all__ = [
    "DEFAULT_TABLE",
    "MAX_IDENTIFIER_BYTES",
    "STAGE_FUNCTION",
    "STAGE_FUNCTION_V2",
    "derived_names",
    "lanes_function",
    "lanes_index",
    "name_problems",
]


def derived_names(table: str) -> dict[str, str]:
    """Every name drain makes from the table's, by placeholder: the tables, indexes and function
    it creates, and the names PostgreSQL gives their keys and sequences (which migrations look
    up). Trigger and constraint names are fixed (``drain_wake``, ``drain_*``): each lives in its
    table's own namespace."""
    dead, schedules, versions = f"{table}_dead", f"{table}_schedules", f"{table}_versions"
    return {
        "table": table,
        "dead": dead,
        "schedules": schedules,
        "versions": versions,
        "due_index": f"{table}_due_idx",
        "run_at_index": f"{table}_run_at_idx",
        "dead_job_id_index": f"{dead}_job_id_idx",
        "dead_id_index": f"{dead}_dead_id_idx",
        "key_index": f"{table}_key_idx",
        "dead_key_index": f"{dead}_key_idx",
        "stage_function": STAGE_FUNCTION if table == DEFAULT_TABLE else f"{table}_stage_v1",
        "stage_function_v2": STAGE_FUNCTION_V2 if table == DEFAULT_TABLE else f"{table}_stage_v2",
        "table_pkey": f"{table}_pkey",
        "table_job_id_key": f"{table}_job_id_key",
        "dead_id_sequence": f"{dead}_dead_id_seq",
        "schedules_pkey": f"{schedules}_pkey",
        "versions_pkey": f"{versions}_pkey",
    }


LANES_NAME_LONGEST = 256
"""config's MAX_LANES: the lane count whose lanes index and function have the longest names."""


def lanes_index(table: str, lanes: int) -> str:
    """The lanes index of a table with ``lanes`` lanes (drain.relay.lanes): one per lane count, so
    the index of a new count can be built while drains of the old one run."""
    return f"{table}_lanes{lanes}_idx"


def lanes_function(table: str, lanes: int) -> str:
    """The function that reads each lane's first due rows through the lanes index of that count
    (migrations.sql ``lanes_function``)."""
    return f"{table}_lanes{lanes}_due"


def name_problems(schema: str, table: str) -> list[str]:
    """One line per setting (``schema``, ``table``) a name of which would pass PostgreSQL's 63
    bytes; empty when they all fit."""
    found = []
    for key, name in (("schema", schema), ("table", table)):
        if "%" in name or "\x00" in name:
            # drain's statements carry the names as quoted identifiers in texts psycopg reads for
            # %-placeholders: a % there failed every statement, or named another table (%%)
            found.append(f"{key}: a name with '%' or a NUL character is not supported: {name!r}")
    if len(schema.encode()) > MAX_IDENTIFIER_BYTES:
        found.append(
            f"schema: {len(schema.encode())} bytes, and PostgreSQL keeps {MAX_IDENTIFIER_BYTES} "
            "of an identifier (it would truncate it without a word)"
        )
    made = [
        *derived_names(table).values(),
        lanes_index(table, LANES_NAME_LONGEST),
        lanes_function(table, LANES_NAME_LONGEST),
    ]
    longest = max(made, key=lambda name: len(name.encode()))
    size = len(longest.encode())
    if size > MAX_IDENTIFIER_BYTES:
        room = MAX_IDENTIFIER_BYTES - (size - len(table.encode()))
        found.append(
            f"table: drain derives the name {longest!r} ({size} bytes) from it, and PostgreSQL "
            f"keeps {MAX_IDENTIFIER_BYTES} bytes of an identifier: use at most {room} bytes"
        )
    return found
