"""Django: drain.contrib.django stages on ``connections[using]`` inside ``transaction.atomic``,
and its migration creates what ``drain migrate`` does.

Django is configured once per test process (settings.configure); each test points the aliases
at its own databases. "default" points at a database without a staged-jobs table, so a call
that ignored ``using=`` would fail.
"""

from __future__ import annotations

import urllib.parse
import uuid
from collections.abc import Iterator

import psycopg
import pytest

import drain
from drain.store import migrations
from tests.conftest import admin_dsn
from tests.stacks.harness import COMMITTED, ROLLED_BACK, StackRig, stack_fixture  # noqa: F401
from tests.support import tasks

django = pytest.importorskip("django")
from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connections, transaction  # noqa: E402
from django.test.utils import override_settings  # noqa: E402

from drain.contrib import django as drain_django  # noqa: E402


def database_settings(dsn: str) -> dict[str, object]:
    url = urllib.parse.urlsplit(dsn)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": url.path.lstrip("/"),
        "USER": url.username or "",
        "HOST": url.hostname or "",
        "PORT": str(url.port or ""),
    }


def point(alias: str, dsn: str) -> None:
    if not settings.configured:
        settings.configure(
            DATABASES={"default": database_settings(dsn), "other": database_settings(dsn)},
            INSTALLED_APPS=["drain.contrib.django"],
            USE_TZ=True,
        )
        django.setup()
    connections[alias].close()
    connections[alias].settings_dict.update(database_settings(dsn))


@pytest.fixture
def empty_database() -> Iterator[str]:
    name = f"drain_test_django_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield admin_dsn(name)
    for alias in ("default", "other"):
        if settings.configured:
            connections[alias].close()
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_atomic_on_another_alias(stack: StackRig, empty_database: str) -> None:
    point("default", empty_database)  # no staged_jobs there
    point("other", stack.dsn)
    try:
        with transaction.atomic(using="other"):
            drain_django.stage(tasks.record, args=[COMMITTED], queue=stack.queue, using="other")
            stack.drain_sees_nothing()
        with pytest.raises(RuntimeError), transaction.atomic(using="other"):
            drain_django.stage(tasks.record, args=[ROLLED_BACK], queue=stack.queue, using="other")
            raise RuntimeError("the view fails after staging")
        # a savepoint rolled back takes its job with it; the outer block commits
        with (
            transaction.atomic(using="other"),
            pytest.raises(RuntimeError),
            transaction.atomic(using="other"),
        ):
            jobs = [drain.Job(tasks.record, args=[ROLLED_BACK], queue=stack.queue)]
            drain_django.stage_many(jobs, using="other")
            raise RuntimeError("the inner block fails")
    finally:
        connections["other"].close()
    stack.only_committed_delivered()


def test_outside_atomic_the_job_commits_alone_and_a_warning_says_so(stack: StackRig) -> None:
    point("default", stack.dsn)
    try:
        with pytest.warns(drain.AutocommitWarning, match="committed on its own"):
            drain_django.stage(tasks.record, args=[COMMITTED], queue=stack.queue)
    finally:
        connections["default"].close()
    stack.only_committed_delivered()


def test_a_django_cursor_is_a_connection_too(stack: StackRig) -> None:
    point("default", stack.dsn)
    try:
        with transaction.atomic(), connections["default"].cursor() as cursor:
            drain.stage(cursor, tasks.record, args=[COMMITTED], queue=stack.queue)
            stack.drain_sees_nothing()
        with pytest.raises(RuntimeError), transaction.atomic(), connections["default"].cursor() as cursor:
            staged = drain.stage(cursor, tasks.record, args=[ROLLED_BACK], on_conflict="ignore")
            assert staged.staged
            raise RuntimeError("rolled back")
        with pytest.warns(drain.AutocommitWarning), connections["default"].cursor() as cursor:
            drain.stage(cursor, tasks.record, args=[COMMITTED], queue=stack.queue)
    finally:
        connections["default"].close()
    stack.only_committed_delivered(expected=2)


def function_exists(dsn: str, schema: str, name: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = %s AND p.proname = %s",
            (schema, name),
        ).fetchone()
    return bool(row and row[0])


def test_the_migration_creates_what_drain_migrate_does(empty_database: str) -> None:
    point("default", empty_database)
    call_command("migrate", "drain", database="default", verbosity=0)
    assert function_exists(empty_database, "public", "drain_stage_v1")
    assert function_exists(empty_database, "public", "drain_stage_v2")
    with transaction.atomic():
        job_id = drain_django.stage("app.tasks.a", on_conflict="ignore")
        assert job_id.staged
        keyed = drain_django.stage("app.tasks.b", ordering_key="order-42", on_conflict="ignore")
        many = drain_django.stage_many(
            [drain.Job("app.tasks.c", ordering_key="order-42"), {"job_name": "app.d"}]
        )
    with psycopg.connect(empty_database) as conn:
        rows = conn.execute("SELECT job_id, ordering_key FROM staged_jobs ORDER BY id").fetchall()
        assert rows == [
            (job_id.job_id, None),
            (keyed.job_id, "order-42"),
            (many[0], "order-42"),
            (many[1], None),
        ]
        assert conn.execute("SELECT drain_stage_v2('app.tasks.e', ordering_key => 'k')").fetchone()
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM staged_jobs_dead").fetchone() == (0,)
    connections["default"].close()


def test_the_migration_and_stage_honour_drain_schema_and_table(empty_database: str) -> None:
    point("default", empty_database)
    with override_settings(DRAIN_SCHEMA="jobs", DRAIN_TABLE="app_jobs"):
        call_command("migrate", "drain", database="default", verbosity=0)
        assert function_exists(empty_database, "jobs", "app_jobs_stage_v1")
        assert function_exists(empty_database, "jobs", "app_jobs_stage_v2")
        with transaction.atomic():
            drain_django.stage("app.tasks.a", ordering_key="k")
    with psycopg.connect(empty_database) as conn:
        assert conn.execute("SELECT job_name, ordering_key FROM jobs.app_jobs").fetchall() == [
            ("app.tasks.a", "k")
        ]
        assert conn.execute("SELECT to_regclass('public.staged_jobs')").fetchone() == (None,)
    connections["default"].close()


@pytest.mark.parametrize("applied", ["0002_wake_trigger", None])
def test_the_migrations_upgrade_a_table_of_drain_0_1_0(applied: str | None) -> None:
    """0003 upgrades an install whose 0001/0002 ran with drain 0.1.0; 0001 upgrades a table
    0.1.0's `drain migrate` made before the project added the Django app."""
    from tests.support import schema_v1

    with schema_v1.empty_database() as dsn:
        schema_v1.install(dsn)
        point("default", dsn)
        try:
            if applied:
                call_command("migrate", "drain", applied, database="default", fake=True, verbosity=0)
            call_command("migrate", "drain", database="default", verbosity=0)
        finally:
            connections["default"].close()
        with psycopg.connect(dsn) as conn:
            latest = conn.execute("SELECT max(version) FROM staged_jobs_versions").fetchone()
            assert latest == (migrations.LATEST_VERSION,)
            assert conn.execute(
                "SELECT count(*) FROM pg_constraint WHERE conrelid = 'staged_jobs'::regclass "
                "AND conname = 'drain_job_check' AND convalidated"
            ).fetchone() == (1,)
