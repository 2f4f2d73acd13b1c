"""Add the wake-up trigger (``drain_wake`` and its function) to an install migrated before it
existed: 0001 runs ``drain migrate``'s SQL as it was when it was applied.

It runs that SQL again, as ``drain migrate`` does on an existing install: every statement is
idempotent (CREATE ... IF NOT EXISTS, CREATE OR REPLACE FUNCTION, the trigger created only where
it is missing), so on a fresh install, where 0001 already created the trigger, it changes
nothing, and a trigger someone disabled stays disabled (``drain check`` reports it). Reversing it
keeps the trigger: without it an idle drain wakes on its poll only.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from drain import sql
from drain.contrib.django import schema_and_table


def _add_trigger(apps: Any, schema_editor: Any) -> None:
    names = sql.Names(*schema_and_table())
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(sql.schema(names).as_string(None))


class Migration(migrations.Migration):
    dependencies: ClassVar[list[tuple[str, str]]] = [("drain", "0001_staged_jobs")]
    operations: ClassVar[list[Any]] = [migrations.RunPython(_add_trigger, migrations.RunPython.noop)]
