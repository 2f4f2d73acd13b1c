"""Add the wake-up trigger (``drain_wake`` and its function) to an install migrated before it
existed.

It runs `drain migrate` again (drain.store.migrations.upgrade), which replaces the functions and
creates the trigger where it is missing: on a fresh install, where 0001 already did, it changes
nothing, and a trigger someone disabled stays disabled (``drain check`` reports it). Reversing it
keeps the trigger: without it an idle drain wakes on its poll only.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from drain.contrib.django import schema


class Migration(migrations.Migration):
    atomic = False
    dependencies: ClassVar[list[tuple[str, str]]] = [("drain", "0001_staged_jobs")]
    operations: ClassVar[list[Any]] = [migrations.RunPython(schema.upgrade, migrations.RunPython.noop)]
