"""stage()/stage_many() on a real database: inside the caller's transaction, never committing."""

from __future__ import annotations

import datetime
import uuid

import psycopg
import pytest

import drain


def rows(dsn: str) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options "
            "FROM staged_jobs ORDER BY id"
        ).fetchall()


def test_stage_is_part_of_the_callers_transaction(database: str) -> None:
    with psycopg.connect(database) as conn:
        job_id = drain.stage(conn, "app.tasks.send_email", args=["a@example.com"], kwargs={"x": 1})
        assert isinstance(job_id, uuid.UUID)
        assert rows(database) == []  # not committed: invisible to everyone else
        conn.rollback()
    assert rows(database) == []
    with psycopg.connect(database) as conn:
        job_id = drain.stage(conn, "app.tasks.send_email", args=["a@example.com"], queue="mail")
        conn.commit()
    (row,) = rows(database)
    assert row[:6] == ("app.tasks.send_email", ["a@example.com"], {}, "mail", "default", job_id)


def test_stage_on_a_cursor_and_own_job_id(database: str) -> None:
    chosen = uuid.uuid4()
    with psycopg.connect(database) as conn, conn.cursor() as cursor:
        assert drain.stage(cursor, "app.t", job_id=chosen, options={"timeout": 5}) == chosen
    (row,) = rows(database)
    assert row[5] == chosen and row[7] == {"timeout": 5}


def test_duplicate_job_id_fails_the_transaction(database: str) -> None:
    chosen = uuid.uuid4()
    with psycopg.connect(database) as conn:
        drain.stage(conn, "app.t", job_id=chosen)
        with pytest.raises(psycopg.errors.UniqueViolation):
            drain.stage(conn, "app.t", job_id=chosen)


def test_run_at_and_delay(database: str) -> None:
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    with psycopg.connect(database) as conn:
        drain.stage(conn, "app.a", run_at=later)
        drain.stage(conn, "app.b", delay=datetime.timedelta(minutes=5))
        drain.stage(conn, "app.c", delay=0)
        drain.stage(conn, "app.d")
    got = {row[0]: row[6] for row in rows(database)}
    assert got["app.a"] == later
    assert got["app.b"] is not None
    assert datetime.timedelta(minutes=4) < got["app.b"] - datetime.datetime.now(datetime.UTC)
    assert got["app.c"] is not None and got["app.d"] is None


def test_stage_many_is_one_statement_in_order(database: str) -> None:
    jobs = [drain.Job("app.t", args=[i]) for i in range(1000)]
    jobs.append(drain.Job("app.later", delay=60))
    with psycopg.connect(database) as conn:
        ids = drain.stage_many(conn, [*jobs, {"job_name": "app.mapping", "kwargs": {"k": "v"}}])
    assert len(ids) == 1002 and len(set(ids)) == 1002
    got = rows(database)
    assert [row[1] for row in got[:1000]] == [[i] for i in range(1000)]
    assert [row[5] for row in got] == ids
    assert got[1000][6] is not None
    assert got[1001][2] == {"k": "v"}


def test_stage_many_sends_one_round_trip(database: str) -> None:
    with psycopg.connect(database) as conn:
        statements: list[object] = []
        original = conn.execute

        def counting(query: object, params: object = None, **kw: object) -> object:
            statements.append(query)
            return original(query, params, **kw)  # type: ignore[arg-type]

        conn.execute = counting  # type: ignore[method-assign]
        drain.stage_many(conn, [drain.Job("app.t", args=[i]) for i in range(500)])
    assert len(statements) == 1
