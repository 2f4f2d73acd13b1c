"""The second wake-up trigger, ``drain_wake_due``: an UPDATE that sets ``run_at`` (``SET run_at =
NULL`` forwards a parked or delayed row now) wakes a sleeping drain too.

It runs `drain migrate` (drain.store.migrations.upgrade), which replaces the code objects and adds the
trigger where it is missing; on an install 0001 created with it, it changes nothing. Reversing it
keeps the trigger.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from drain.contrib.django import schema


class Migration(migrations.Migration):
    atomic = False
    dependencies: ClassVar[list[tuple[str, str]]] = [("drain", "0003_schema_version_2")]
    operations: ClassVar[list[Any]] = [migrations.RunPython(schema.upgrade, migrations.RunPython.noop)]
