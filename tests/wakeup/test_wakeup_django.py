"""Django installs get the wake-up trigger (issue 14): migration 0002 adds it where an older 0001
ran before the trigger existed, and a fresh ``migrate`` still works and leaves one trigger.

The old install is made for real: migrate to 0001, then drop the trigger and its function (what
0001 created before the wake-up). Whether the trigger works is checked the way the drain uses
it: a sleeping Store holds the wake lock and a commit staged through Django notifies it.
"""

from __future__ import annotations

import psycopg
import pytest

from tests.staging.test_staging_django import empty_database, point  # noqa: F401

django = pytest.importorskip("django")
from django.core.management import call_command  # noqa: E402
from django.db import connections, transaction  # noqa: E402
from django.test.utils import override_settings  # noqa: E402

from drain import config  # noqa: E402
from drain.contrib import django as drain_django  # noqa: E402
from drain.relay import wakeup  # noqa: E402
from drain.store import session as store  # noqa: E402

BEFORE_THE_WAKEUP = """
DROP TRIGGER drain_wake ON {table};
DROP TRIGGER drain_wake_due ON {table};
DROP TRIGGER drain_wake_freed ON {table};
DROP FUNCTION {schema}.drain_wake_v1();
"""


def triggers(dsn: str, schema: str = "public", table: str = "staged_jobs") -> list[str]:
    """tgenabled of every drain_wake trigger on the table ('O': enabled, 'D': disabled)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT t.tgenabled FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s AND t.tgname = 'drain_wake'",
            (schema, table),
        ).fetchall()
    return [str(row[0]) for row in rows]


def applied(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT name FROM django_migrations WHERE app = 'drain' ORDER BY id").fetchall()
    return [str(row[0]) for row in rows]


def migrate(*target: str) -> None:
    call_command("migrate", "drain", *target, database="default", verbosity=0)


def notified_by_a_django_commit(dsn: str, schema: str = "public", table: str = "staged_jobs") -> int:
    """Arm as the sleeping drain does, stage through Django, count the notifications."""
    sleeper = store.Store(config.Settings(dsn=dsn, schema=schema, table=table))
    try:
        armed, channel = sleeper.wake_arm()
        assert armed
        with psycopg.connect(dsn, autocommit=True) as listening:
            listening.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
            with transaction.atomic():
                drain_django.stage("app.tasks.a")
            return sum(1 for _ in listening.notifies(timeout=0.5))
    finally:
        sleeper.close()


def test_0002_adds_the_trigger_to_an_install_migrated_before_it(empty_database: str) -> None:  # noqa: F811
    point("default", empty_database)
    try:
        migrate("0001")
        with psycopg.connect(empty_database, autocommit=True) as conn:
            conn.execute(BEFORE_THE_WAKEUP.format(schema="public", table="staged_jobs"))
        assert triggers(empty_database) == []
        assert applied(empty_database) == ["0001_staged_jobs"]
        assert notified_by_a_django_commit(empty_database) == 0  # the old install: poll only

        migrate()
        assert applied(empty_database)[:2] == ["0001_staged_jobs", "0002_wake_trigger"]
        assert triggers(empty_database) == ["O"]
        assert notified_by_a_django_commit(empty_database) == 1
        db = store.Store(config.Settings(dsn=empty_database))
        try:
            assert wakeup.trigger_warning(db) is None  # what `drain check` asks
        finally:
            db.close()
    finally:
        connections["default"].close()


def test_a_fresh_migrate_leaves_one_trigger_and_0002_keeps_a_disabled_one_disabled(
    empty_database: str,  # noqa: F811
) -> None:
    point("default", empty_database)
    try:
        migrate()
        assert applied(empty_database)[:2] == ["0001_staged_jobs", "0002_wake_trigger"]
        assert triggers(empty_database) == ["O"]
        assert notified_by_a_django_commit(empty_database) == 1

        # 0002 again, over a trigger someone disabled on purpose: it is not re-enabled or doubled
        with psycopg.connect(empty_database, autocommit=True) as conn:
            conn.execute("ALTER TABLE staged_jobs DISABLE TRIGGER drain_wake")
        migrate("0001")
        migrate()
        assert triggers(empty_database) == ["D"]
    finally:
        connections["default"].close()


def test_0002_honours_drain_schema_and_table(empty_database: str) -> None:  # noqa: F811
    point("default", empty_database)
    try:
        with override_settings(DRAIN_SCHEMA="jobs", DRAIN_TABLE="app_jobs"):
            migrate("0001")
            with psycopg.connect(empty_database, autocommit=True) as conn:
                conn.execute(BEFORE_THE_WAKEUP.format(schema="jobs", table="jobs.app_jobs"))
            migrate()
            assert triggers(empty_database, "jobs", "app_jobs") == ["O"]
            assert notified_by_a_django_commit(empty_database, "jobs", "app_jobs") == 1
        assert triggers(empty_database) == []  # nothing created for the default table
    finally:
        connections["default"].close()
