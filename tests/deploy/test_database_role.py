"""The least-privilege drain role of the docs' "Database setup" (docs/operations/database.md):
deploy/database/drain-role.sql applied to a fresh role, a real ``drain run`` as that role forwards
jobs and writes a dead letter, and the role can do nothing else (TRUNCATE, INSERT into the staged
table, DDL, another table)."""

from __future__ import annotations

import re
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import errors as pg_errors
from psycopg import sql

from tests.conftest import admin_dsn
from tests.deploy import files, flow
from tests.support import configs, processes
from tests.support.waiting import wait_until

EXPECTED = {
    ("staged_jobs", "SELECT"),
    ("staged_jobs", "UPDATE"),
    ("staged_jobs", "DELETE"),
    ("staged_jobs_dead", "SELECT"),
    ("staged_jobs_dead", "INSERT"),
    ("staged_jobs_dead", "DELETE"),
    ("staged_jobs_versions", "SELECT"),
}
SCHEDULES = {("staged_jobs_schedules", p) for p in ("SELECT", "INSERT", "UPDATE")}
DATABASE_SETUP = files.ROOT / "docs" / "operations" / "database.md"


def grants_for(role: str) -> str:
    text = files.GRANTS.read_text()
    replaced, count = re.subn(r"\bTO drain;", f"TO {role};", text)
    assert count == text.count("GRANT "), "every GRANT in drain-role.sql names the role drain"
    return replaced


@pytest.fixture
def role(database: str) -> Iterator[str]:
    """A login role of this test's own with exactly drain-role.sql; dropped afterwards."""
    name = f"drain_role_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(grants_for(name).encode())
        yield name
    finally:
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        with psycopg.connect(admin_dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def as_role(database: str, role: str) -> str:
    return re.sub(r"postgresql://[^@]+@", f"postgresql://{role}@", database)


def test_the_role_holds_exactly_the_documented_privileges(database: str, role: str) -> None:
    with psycopg.connect(database) as conn:
        rows = conn.execute(
            "SELECT table_name, privilege_type FROM information_schema.role_table_grants WHERE grantee = %s",
            (role,),
        ).fetchall()
        schedules = conn.execute("SELECT to_regclass('public.staged_jobs_schedules') IS NOT NULL").fetchone()
        functions = conn.execute(
            "SELECT count(*) FROM information_schema.role_routine_grants WHERE grantee = %s", (role,)
        ).fetchone()
    assert set(rows) == EXPECTED | (SCHEDULES if schedules and schedules[0] else set())
    assert functions == (0,)


def test_the_docs_document_exactly_grants_sql() -> None:
    readme = DATABASE_SETUP.read_text()
    for line in files.GRANTS.read_text().splitlines():
        if line.strip().startswith("GRANT "):
            assert line.strip() in readme, line


def test_a_drain_run_as_the_role_forwards_dead_letters_and_stops_cleanly(
    database: str, role: str, redis_db: str, tmp_path: Path
) -> None:
    dsn = as_role(database, role)
    config = configs.write_config(
        tmp_path / "drain.toml",
        dsn,
        {"default": configs.rq(redis_db, ["app.tasks.send_welcome_email"])},
        max_attempts=1,
    )
    drain = processes.start_drain(config, dsn, tmp_path / "drain.log")
    with processes.running(drain):
        # Staged by the owner (the app's role); one of them names a job outside allowed_jobs.
        job_ids = flow.stage(database, ["app.tasks.send_welcome_email"] * 20 + ["os.system"])
        flow.wait_forwarded(database, redis_db, job_ids[:20])
        wait_until("the refused job dead-lettered", lambda: len(flow.dead_letters(database)) == 1, 30)
        ((job_name, error),) = flow.dead_letters(database)
        assert job_name == "os.system" and "allowed_jobs" in error
        assert str(job_ids[20]) not in flow.queued_ids(redis_db)
        # The operator's read-only commands work as the role too.
        status = processes.status(config, dsn)
        assert (status["backlog"], status["dead"]) == (0, 1)
        assert status["leader"] is not None
        checked = processes.drain_cli("check", "--config", str(config), dsn=dsn)
        assert checked.returncode == 0, checked.stderr  # the schema version is readable too
        drain.popen.send_signal(signal.SIGTERM)
        assert drain.popen.wait(timeout=60) == 0, drain.output()
    assert "permission denied" not in drain.output()


@pytest.mark.parametrize(
    "statement",
    [
        "TRUNCATE staged_jobs",
        "TRUNCATE staged_jobs_dead",
        "INSERT INTO staged_jobs (job_name) VALUES ('app.tasks.x')",
        "UPDATE staged_jobs_dead SET error = ''",
        "DROP TABLE staged_jobs",
        "ALTER TABLE staged_jobs SET (autovacuum_enabled = off)",
        "CREATE TABLE public.mine (id int)",
        "CREATE SCHEMA mine",
        "SELECT * FROM ledger_of_someone_else",
    ],
)
def test_the_role_can_do_nothing_else(database: str, role: str, statement: str) -> None:
    with psycopg.connect(database, autocommit=True) as owner:
        owner.execute("CREATE TABLE IF NOT EXISTS ledger_of_someone_else (id int)")
    with (
        psycopg.connect(as_role(database, role), autocommit=True) as conn,
        pytest.raises(pg_errors.InsufficientPrivilege),
    ):
        conn.execute(statement.encode())


def test_drain_migrate_as_the_role_is_refused_not_half_done(database: str, role: str) -> None:
    done = processes.drain_cli("migrate", "--dsn", as_role(database, role), dsn=as_role(database, role))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr


def test_the_docs_state_the_autovacuum_settings_the_migration_applies() -> None:
    schema = (files.ROOT / "drain" / "store" / "sql" / "schema.sql").read_text()
    settings = re.findall(r"(autovacuum_\w+ = \w+)", schema)
    assert len(settings) == 5
    section = DATABASE_SETUP.read_text()
    for setting in settings:
        assert setting in section, setting
