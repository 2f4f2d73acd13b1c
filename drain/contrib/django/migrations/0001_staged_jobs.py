"""Create the staged-jobs table, its dead letters and the SQL staging function.

The SQL is `drain migrate`'s own (idempotent), for the table named by DRAIN_SCHEMA/DRAIN_TABLE.
Reversing it keeps the tables: they may hold jobs nobody has forwarded yet.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from drain import sql
from drain.contrib.django import schema_and_table


def _create(apps: Any, schema_editor: Any) -> None:
    names = sql.Names(*schema_and_table())
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(sql.schema(names).as_string(None))
        cursor.execute(sql.functions(names).as_string(None))


class Migration(migrations.Migration):
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [migrations.RunPython(_create, migrations.RunPython.noop)]
