"""The producer role of the docs' "Security" (docs/security.md): deploy/database/producer-role.sql
applied to a fresh role stages jobs by drain.stage() (plain, idempotent, many, keyed or not),
drain_stage_v1(), drain_stage_v2() and a plain INSERT, and cannot choose a row's id (INSERT ...
OVERRIDING SYSTEM VALUE), its created_at, attempts or last_error, nor read, change or delete rows.
Before, the README granted producers INSERT on the whole table: an id of a producer's choosing took
the ids the identity would hand out later."""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors
from psycopg import sql

import drain
from tests.conftest import admin_dsn
from tests.deploy import files
from tests.deploy.test_database_role import as_role

SECURITY = files.ROOT / "docs" / "security.md"


def grants_for(role: str, text: str | None = None) -> str:
    text = files.PRODUCER_GRANTS.read_text() if text is None else text
    replaced, count = re.subn(r"\b(TO|FROM) producer;", rf"\1 {role};", text)
    statements = sum(1 for line in text.splitlines() if line.startswith(("GRANT ", "REVOKE ")))
    assert count == statements, "every GRANT and REVOKE in producer-role.sql names the role producer"
    return replaced


@pytest.fixture
def producer(database: str) -> Iterator[str]:
    """A login role of this test's own that once had INSERT on the whole table (what the README
    used to say), then producer-role.sql; dropped afterwards."""
    with role_with(database, files.PRODUCER_GRANTS.read_text()) as dsn:
        yield dsn


# producer-role.sql's INSERT grant before ordering_key: what a deployed producer role holds.
EARLIER_GRANT = "(job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options)"


@pytest.fixture
def earlier_producer(database: str) -> Iterator[str]:
    """A role granted producer-role.sql as it was before ordering_key existed."""
    text = files.PRODUCER_GRANTS.read_text()
    earlier = re.sub(r"INSERT \([^)]*\)", f"INSERT {EARLIER_GRANT}", text)
    assert earlier != text and "ordering_key)" not in earlier
    with role_with(database, earlier) as dsn:
        yield dsn


@contextlib.contextmanager
def role_with(database: str, grants: str) -> Iterator[str]:
    name = f"drain_producer_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(sql.SQL("GRANT INSERT ON staged_jobs TO {}").format(sql.Identifier(name)))
            conn.execute(grants_for(name, grants).encode())
        yield as_role(database, name)
    finally:
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        with psycopg.connect(admin_dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def staged(database: str) -> list[tuple[int, str]]:
    with psycopg.connect(database) as conn:
        rows = conn.execute("SELECT id, job_name FROM staged_jobs ORDER BY id").fetchall()
    return [(int(row_id), str(name)) for row_id, name in rows]


def test_the_producer_stages_every_documented_way(database: str, producer: str) -> None:
    key = uuid.uuid4()
    with psycopg.connect(producer) as conn:
        drain.stage(conn, "app.tasks.plain", args=[1])
        assert drain.stage(conn, "app.tasks.once", job_id=key, on_conflict="ignore").staged
        assert not drain.stage(conn, "app.tasks.once", job_id=key, on_conflict="ignore").staged
        drain.stage_many(conn, [drain.Job("app.tasks.many", args=[n]) for n in range(2)])
        drain.stage_many(conn, [drain.Job("app.tasks.many_once", job_id=key)], on_conflict="ignore")
        conn.execute("SELECT drain_stage_v1('app.tasks.sql', '[1]'::jsonb, delay_s => 0)")
        conn.execute(
            "INSERT INTO staged_jobs "
            "(job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options) VALUES "
            "('app.tasks.insert', '[]', '{}', 'q', 'default', gen_random_uuid(), now(), '{}')"
        )
        drain.stage(conn, "app.tasks.keyed", ordering_key="order-42")
        drain.stage(conn, "app.tasks.keyed_once", ordering_key="order-42", on_conflict="ignore")
        drain.stage_many(conn, [drain.Job("app.tasks.keyed_many", ordering_key="order-42")])
        drain.stage_many(
            conn, [{"job_name": "app.tasks.keyed_many", "ordering_key": "k"}], on_conflict="ignore"
        )
        conn.execute("SELECT drain_stage_v2('app.tasks.sql_keyed', ordering_key => 'order-42')")
        conn.execute("SELECT drain_stage_v2('app.tasks.sql_v2')")
    names = [name for _, name in staged(database)]
    assert names == [
        "app.tasks.plain",
        "app.tasks.once",
        "app.tasks.many",
        "app.tasks.many",
        "app.tasks.sql",
        "app.tasks.insert",
        "app.tasks.keyed",
        "app.tasks.keyed_once",
        "app.tasks.keyed_many",
        "app.tasks.keyed_many",
        "app.tasks.sql_keyed",
        "app.tasks.sql_v2",
    ]


def test_a_producer_granted_before_ordering_key_stages_unkeyed_jobs_as_before(
    database: str, earlier_producer: str
) -> None:
    """Upgrading drain asks nothing of a deployed producer role: a job without a key is staged by
    statements that name no ordering_key column. A keyed one needs the new grant."""
    key = uuid.uuid4()
    with psycopg.connect(earlier_producer) as conn:
        drain.stage(conn, "app.tasks.plain", ordering_key=None)
        assert drain.stage(conn, "app.tasks.once", job_id=key, on_conflict="ignore").staged
        drain.stage_many(conn, [drain.Job("app.tasks.many"), {"job_name": "app.tasks.many"}])
        drain.stage_many(conn, [drain.Job("app.tasks.many_once")], on_conflict="ignore")
        conn.execute("SELECT drain_stage_v1('app.tasks.sql')")
    assert [name for _, name in staged(database)] == [
        "app.tasks.plain",
        "app.tasks.once",
        "app.tasks.many",
        "app.tasks.many",
        "app.tasks.many_once",
        "app.tasks.sql",
    ]
    keyed: list[Callable[[psycopg.Connection[Any]], object]] = [
        lambda conn: drain.stage(conn, "app.tasks.keyed", ordering_key="k"),
        lambda conn: drain.stage_many(
            conn, [drain.Job("app.tasks.a"), drain.Job("app.tasks.b", ordering_key="k")]
        ),
        lambda conn: conn.execute("SELECT drain_stage_v2('app.tasks.a')"),
    ]
    for attempt in keyed:
        with psycopg.connect(earlier_producer) as conn, pytest.raises(pg_errors.InsufficientPrivilege):
            attempt(conn)


@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO staged_jobs (id, job_name) OVERRIDING SYSTEM VALUE VALUES (1000000, 'app.tasks.squat')",
        "INSERT INTO staged_jobs OVERRIDING SYSTEM VALUE SELECT 1000000, 'app.tasks.squat'",
        "INSERT INTO staged_jobs (job_name, created_at) VALUES ('app.tasks.x', now() - interval '1 day')",
        "INSERT INTO staged_jobs (job_name, attempts) VALUES ('app.tasks.x', 1000)",
        "INSERT INTO staged_jobs (job_name, last_error) VALUES ('app.tasks.x', 'forged')",
        "SELECT job_name, job_args FROM staged_jobs",
        "UPDATE staged_jobs SET run_at = 'infinity'",
        "DELETE FROM staged_jobs",
        "TRUNCATE staged_jobs",
        "SELECT * FROM staged_jobs_dead",
    ],
)
def test_the_producer_chooses_no_id_and_touches_nothing_else(
    database: str, producer: str, statement: str
) -> None:
    with psycopg.connect(database) as owner:
        drain.stage(owner, "app.tasks.before")
    with (
        psycopg.connect(producer, autocommit=True) as conn,
        pytest.raises(pg_errors.InsufficientPrivilege),
    ):
        conn.execute(statement.encode())
    with psycopg.connect(producer) as conn:
        drain.stage(conn, "app.tasks.after")
    (before, _), (after, _) = staged(database)
    assert after == before + 1  # the identity hands out its next id: nothing was taken


def test_the_docs_document_exactly_producer_role_sql() -> None:
    readme = SECURITY.read_text()
    assert "deploy/database/producer-role.sql" in readme
    for line in files.PRODUCER_GRANTS.read_text().splitlines():
        if line.strip().startswith(("GRANT ", "REVOKE ")):
            assert line.strip() in readme, line
