"""Schema version 3: an ordering key on each row (``ordering_key``, its check and its index).

It runs `drain migrate` (drain.store.migrations.upgrade), which adds the column to the table and the
dead letters (a catalog change), then builds the index CONCURRENTLY: non-atomic, like 0003.
Reversing it keeps the column.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from drain.contrib.django import schema


class Migration(migrations.Migration):
    atomic = False
    dependencies: ClassVar[list[tuple[str, str]]] = [("drain", "0004_wake_on_update")]
    operations: ClassVar[list[Any]] = [migrations.RunPython(schema.upgrade, migrations.RunPython.noop)]
