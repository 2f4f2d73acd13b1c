"""``drain migrate`` from a Django migration: the same :func:`drain.store.migrations.upgrade`, on the
migration's connection, for the table named by DRAIN_SCHEMA/DRAIN_TABLE.

A migration that calls it sets ``atomic = False``: an upgrade runs transactions of its own (a
brief lock each) and statements that cannot run inside one (CREATE INDEX CONCURRENTLY).
"""

from __future__ import annotations

import contextlib
from typing import Any

from django.db import transaction
from psycopg import sql as pgsql

from drain.contrib.django import schema_and_table
from drain.store import migrations, sql


class _Session:
    """A migrations.Runner over a Django connection in autocommit mode."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def transaction(self) -> contextlib.AbstractContextManager[Any]:
        block: contextlib.AbstractContextManager[Any] = transaction.atomic(using=self.connection.alias)
        return block

    def execute(self, statement: pgsql.Composed) -> int:
        with self.connection.cursor() as cursor:
            cursor.execute(statement.as_string(None))
            return int(cursor.rowcount)

    def fetch(self, statement: pgsql.Composed) -> list[tuple[Any, ...]]:
        with self.connection.cursor() as cursor:
            cursor.execute(statement.as_string(None))
            return list(cursor.fetchall())


def upgrade(apps: Any, schema_editor: Any) -> None:
    """RunPython: create the table at the current schema version, or upgrade it in place."""
    # in Django's transaction: the lock waited for in one statement (upgrade's poll_lock)
    migrations.upgrade(_Session(schema_editor.connection), sql.Names(*schema_and_table()), poll_lock=False)
