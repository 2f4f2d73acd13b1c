"""The third wake-up trigger, ``drain_wake_freed``: an app's DELETE (the row ahead of a keyed row
cancelled, a parked row cleaned up) wakes a sleeping drain, whose freed rows no INSERT announces.

It runs `drain migrate` (drain.store.migrations.upgrade), which replaces the code objects and adds the
trigger where it is missing; on an install that has it, it changes nothing. Reversing it keeps the
trigger.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from drain.contrib.django import schema


class Migration(migrations.Migration):
    atomic = False
    dependencies: ClassVar[list[tuple[str, str]]] = [("drain", "0005_schema_version_3")]
    operations: ClassVar[list[Any]] = [migrations.RunPython(schema.upgrade, migrations.RunPython.noop)]
