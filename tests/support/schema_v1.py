"""A table of drain 0.1.0's schema (version 1): the starting point of the upgrade tests.

``tests/fixtures/schema_v1`` holds that release's schema.sql and functions.sql as they were;
``install`` runs them for a table, as 0.1.0's ``drain migrate`` did.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg import sql as pgsql

from drain.store import sql
from tests.conftest import admin_dsn

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "schema_v1"


def install(dsn: str, schema: str = "public", table: str = "staged_jobs") -> None:
    """Create ``schema.table`` and its dead letters as drain 0.1.0 did."""
    names = sql.Names(schema, table)
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        for filename in ("schema.sql", "functions.sql"):
            text = FIXTURE.joinpath(filename).read_text()
            conn.execute(pgsql.SQL(text).format(**names.identifiers(), **names.literals()))  # type: ignore[arg-type]


@contextlib.contextmanager
def empty_database() -> Iterator[str]:
    """A database of its own with nothing in it (not the migrated template); dropped after."""
    name = f"drain_test_v1_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))
    try:
        yield admin_dsn(name)
    finally:
        with psycopg.connect(admin_dsn(), autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(pgsql.Identifier(name)))
