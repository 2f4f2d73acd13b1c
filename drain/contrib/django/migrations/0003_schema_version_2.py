"""Schema version 2 (drain.store.migrations): dead letters numbered on their own, and the constraints
that refuse what no backend can carry, added in place while producers stage and a drain
forwards (NOT VALID, then validated; rows already breaking one become dead letters).

It runs `drain migrate` (drain.store.migrations.upgrade), which upgrades whatever version the table is
at; on an install 0001 created at this version it changes nothing. Reversing it keeps the schema.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from drain.contrib.django import schema


class Migration(migrations.Migration):
    atomic = False
    dependencies: ClassVar[list[tuple[str, str]]] = [("drain", "0002_wake_trigger")]
    operations: ClassVar[list[Any]] = [migrations.RunPython(schema.upgrade, migrations.RunPython.noop)]
