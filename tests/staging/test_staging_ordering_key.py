"""``ordering_key`` through every way Python stages (issue 25): the key lands in the row as given,
jobs of one key get ids in the order they were staged (one call after another, and in the list's
order within one ``stage_many``), ``on_conflict="ignore"`` carries the key, and an unkeyed job is
staged exactly as before (its statement names no ``ordering_key`` column)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import psycopg2
import pytest
import sqlalchemy
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import drain
from drain.staging import sync as staging_sync

KEY = "order-42 ünïcode 🔑"
OTHER = "order-43"


def keys(dsn: str) -> list[tuple[uuid.UUID, str | None]]:
    """(job_id, ordering_key) of every committed row, in id order."""
    with psycopg.connect(dsn) as conn:
        return [
            (row[0], row[1])
            for row in conn.execute("SELECT job_id, ordering_key FROM staged_jobs ORDER BY id")
        ]


def ids_of(results: list[Any]) -> list[uuid.UUID]:
    return [result.job_id if isinstance(result, drain.Staged) else result for result in results]


def stage_everything(
    stage: Callable[..., Any], stage_many: Callable[..., Any]
) -> list[tuple[uuid.UUID, str | None]]:
    """Stage keyed and unkeyed jobs every way one connection kind offers; what the rows must hold."""
    first = stage("app.tasks.paid", ordering_key=KEY)
    unkeyed = stage("app.tasks.plain")
    chosen = uuid.uuid4()
    ignored = stage("app.tasks.refunded", ordering_key=OTHER, job_id=chosen, on_conflict="ignore")
    assert ignored == drain.Staged(chosen, staged=True)
    again = stage("app.tasks.refunded", ordering_key=KEY, job_id=chosen, on_conflict="ignore")
    assert again == drain.Staged(chosen, staged=False)  # the first row, its key unchanged
    many = stage_many([drain.Job("app.tasks.shipped", ordering_key=KEY), {"job_name": "app.tasks.b"},
                       {"job_name": "app.tasks.delivered", "ordering_key": KEY}])  # fmt: skip
    once = stage_many([drain.Job("app.tasks.closed", ordering_key=KEY)], on_conflict="ignore")
    assert [each.staged for each in once] == [True]
    many_ids = ids_of(many)
    return [
        (first, KEY),
        (unkeyed, None),
        (chosen, OTHER),
        (many_ids[0], KEY),
        (many_ids[1], None),
        (many_ids[2], KEY),
        (once[0].job_id, KEY),
    ]


@contextlib.contextmanager
def sync_connection(kind: str, dsn: str) -> Iterator[tuple[Any, Callable[[], None]]]:
    """A connection of ``kind`` and how to commit it."""
    if kind in ("psycopg", "psycopg_cursor"):
        with psycopg.connect(dsn) as conn:
            if kind == "psycopg":
                yield conn, conn.commit
            else:
                with conn.cursor() as cursor:
                    yield cursor, conn.commit
    elif kind in ("psycopg2", "psycopg2_cursor"):
        conn2 = psycopg2.connect(dsn)
        try:
            yield (conn2 if kind == "psycopg2" else conn2.cursor()), conn2.commit
        finally:
            conn2.close()
    else:
        driver = "psycopg2" if kind.endswith("psycopg2") else "psycopg"
        engine = sqlalchemy.create_engine(dsn.replace("postgresql://", f"postgresql+{driver}://", 1))
        try:
            if kind == "sqlalchemy_session":
                with orm.Session(engine) as session:
                    yield session, session.commit
            else:
                with engine.connect() as connection:
                    yield connection, connection.commit
        finally:
            engine.dispose()


SYNC_KINDS = [
    "psycopg",
    "psycopg_cursor",
    "psycopg2",
    "psycopg2_cursor",
    "sqlalchemy_psycopg",
    "sqlalchemy_psycopg2",
    "sqlalchemy_session",
]


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_every_sync_connection_stages_the_key(database: str, kind: str) -> None:
    with sync_connection(kind, database) as (conn, commit):
        expected = stage_everything(
            lambda *args, **kwargs: drain.stage(conn, *args, **kwargs),
            lambda *args, **kwargs: drain.stage_many(conn, *args, **kwargs),
        )
        assert keys(database) == []
        commit()
    assert keys(database) == expected


@pytest.mark.parametrize("kind", ["psycopg", "psycopg_cursor", "sqlalchemy_session", "sqlalchemy_connection"])
def test_every_async_connection_stages_the_key(database: str, kind: str) -> None:
    async def scenario() -> list[tuple[uuid.UUID, str | None]]:
        loop = asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as stack:
            if kind.startswith("psycopg"):
                aconn = await stack.enter_async_context(await psycopg.AsyncConnection.connect(database))
                conn: Any = aconn if kind == "psycopg" else aconn.cursor()
                commit: Any = aconn.commit
            else:
                engine = create_async_engine(database.replace("postgresql://", "postgresql+psycopg://", 1))
                stack.push_async_callback(engine.dispose)
                if kind == "sqlalchemy_session":
                    conn = await stack.enter_async_context(AsyncSession(engine))
                else:
                    conn = await stack.enter_async_context(engine.connect())
                commit = conn.commit

            def stage(*args: Any, **kwargs: Any) -> Any:
                return asyncio.run_coroutine_threadsafe(drain.astage(conn, *args, **kwargs), loop).result()

            def stage_many(*args: Any, **kwargs: Any) -> Any:
                return asyncio.run_coroutine_threadsafe(
                    drain.astage_many(conn, *args, **kwargs), loop
                ).result()

            expected = await asyncio.to_thread(stage_everything, stage, stage_many)
            await commit()
            return expected

    expected = asyncio.run(scenario())
    assert keys(database) == expected


def test_keys_keep_the_order_of_the_calls_and_of_the_list_across_statements(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stage_many splits a list past MAX_STATEMENT_BYTES into statements: each names the column
    only when one of its rows has a key, and the ids still follow the list."""
    monkeypatch.setattr(staging_sync, "MAX_STATEMENT_BYTES", 1)  # one row per statement
    jobs = [drain.Job("app.tasks.a", args=[n], ordering_key=KEY if n % 3 else None) for n in range(9)]
    with psycopg.connect(database) as conn:
        ids = drain.stage_many(conn, jobs)
        ids += ids_of(drain.stage_many(conn, jobs[::-1], on_conflict="ignore"))
    expected = [KEY if n % 3 else None for n in range(9)]
    assert keys(database) == list(zip(ids, expected + expected[::-1], strict=True))


def test_one_statement_of_many_keyed_jobs_follows_the_list(database: str) -> None:
    jobs = [drain.Job("app.tasks.a", args=[n], ordering_key=f"k{n % 7}") for n in range(500)]
    with psycopg.connect(database) as conn:
        ids = drain.stage_many(conn, jobs)
        again = drain.stage_many(conn, [drain.Job("app.tasks.a", job_id=uuid.uuid4(), ordering_key=KEY)] * 2,
                                 on_conflict="ignore")  # fmt: skip
    assert [job_id for job_id, _ in keys(database)] == [*ids, again[0].job_id]
    assert [each.staged for each in again] == [True, False]


def test_the_table_refuses_what_stage_refuses_and_stage_sends_nothing(database: str) -> None:
    with psycopg.connect(database) as conn:
        with pytest.raises(drain.StagingError, match="ordering_key is 256 bytes"):
            drain.stage(conn, "app.tasks.a", ordering_key="é" * 128)
        drain.stage(conn, "app.tasks.a", ordering_key="é" * 127 + "k")  # 255 bytes: the transaction goes on
        conn.commit()
    assert [key for _, key in keys(database)] == ["é" * 127 + "k"]
