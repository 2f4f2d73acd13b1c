"""Stage jobs from Django, on the connection of a database alias, inside ``transaction.atomic``.

Add ``"drain.contrib.django"`` to ``INSTALLED_APPS`` and ``manage.py migrate`` creates the
staged-jobs table and the SQL staging function (its migration runs the same SQL as
``drain migrate``; ``DRAIN_SCHEMA``/``DRAIN_TABLE`` in settings name another table). Then::

    from django.db import transaction
    from drain.contrib import django as drain_django

    with transaction.atomic(using="orders"):
        order.save(using="orders")
        drain_django.stage("app.tasks.send_receipt", args=[order.pk], using="orders")

The job commits with the ``atomic`` block or not at all. Outside an atomic block Django runs in
autocommit mode: the job is committed at once, and an :class:`drain.AutocommitWarning` says so.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections

from drain import models
from drain.staging import sync as staging
from drain.staging.rows import JobName

__all__ = ["schema_and_table", "stage", "stage_many"]


def schema_and_table() -> tuple[str, str]:
    """The table this project stages into: settings DRAIN_SCHEMA / DRAIN_TABLE, or the defaults."""
    return (
        getattr(settings, "DRAIN_SCHEMA", models.DEFAULT_SCHEMA),
        getattr(settings, "DRAIN_TABLE", models.DEFAULT_TABLE),
    )


def stage(job_name: JobName, *, using: str = DEFAULT_DB_ALIAS, **options: Any) -> Any:
    """:func:`drain.stage` on ``connections[using]``; takes the same keyword arguments and returns
    what it returns (a UUID, or a :class:`drain.Staged` with ``on_conflict="ignore"``)."""
    schema, table = schema_and_table()
    return staging.stage(connections[using], job_name, schema=schema, table=table, **options)


def stage_many(
    jobs: Iterable[staging.Job | Mapping[str, Any]], *, using: str = DEFAULT_DB_ALIAS, **options: Any
) -> list[uuid.UUID] | list[staging.Staged]:
    """:func:`drain.stage_many` on ``connections[using]``."""
    schema, table = schema_and_table()
    return staging.stage_many(connections[using], jobs, schema=schema, table=table, **options)
