"""A login role of a test's own with the drain's grants (docs "Database setup"): not a superuser,
so grants, triggers and row-level security apply to it as they do in production."""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator

import psycopg
from psycopg import sql

from tests.conftest import admin_dsn


def execute(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement.encode())


@contextlib.contextmanager
def drain_role(database: str, *, insert: bool = False, prefix: str = "drain_role") -> Iterator[str]:
    """``database``'s DSN as a fresh login role with the drain's grants, and INSERT on the table
    too if ``insert`` (as with [[schedules]]); the role and what it owns are dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        execute(
            database,
            f"GRANT USAGE ON SCHEMA public TO {name}; "
            f"GRANT SELECT, UPDATE, DELETE{', INSERT' if insert else ''} ON staged_jobs TO {name}; "
            f"GRANT SELECT, INSERT, DELETE ON staged_jobs_dead TO {name}; "
            f"GRANT SELECT ON staged_jobs_versions TO {name}",
        )
        yield re.sub(r"postgresql://[^@]+@", f"postgresql://{name}@", database)
    finally:
        execute(database, f"DROP OWNED BY {name}")
        with psycopg.connect(admin_dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def user_of(dsn: str) -> str:
    """The role a DSN logs in as."""
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["user"])
