"""Create the staged-jobs table, its dead letters and the SQL staging function.

It runs `drain migrate` (drain.store.migrations.upgrade: idempotent) for the table named by
DRAIN_SCHEMA/DRAIN_TABLE: a fresh install at the current schema version, or the upgrade of one
`drain migrate` made. Not atomic: an upgrade runs transactions of its own. Reversing it keeps the
tables: they may hold jobs nobody has forwarded yet.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from drain.contrib.django import schema


class Migration(migrations.Migration):
    initial = True
    atomic = False
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [migrations.RunPython(schema.upgrade, migrations.RunPython.noop)]
