"""asyncio stacks: psycopg AsyncConnection/AsyncCursor and SQLAlchemy AsyncSession/AsyncConnection.

Each proves invisible-until-commit, committed → delivered, rolled back → never (tests.stacks.harness).
And the bug this replaces: the sync stage() handed an async connection returned an id and staged
nothing; now it raises StagingError at once, and nothing is staged.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Coroutine
from typing import Any

import psycopg
import pytest
import sqlalchemy
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import drain
from tests.stacks.harness import COMMITTED, ROLLED_BACK, StackRig, stack_fixture  # noqa: F401
from tests.support import tasks


def run(coroutine: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coroutine)


def count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    assert row is not None
    return int(row[0])


def test_psycopg_async_connection(stack: StackRig) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(stack.dsn) as conn:
            job_id = await drain.astage(conn, tasks.record, args=[COMMITTED], queue=stack.queue)
            assert job_id.version == 4
            await asyncio.to_thread(stack.drain_sees_nothing)
            await conn.commit()
            await drain.astage_many(conn, [drain.Job(tasks.record, args=[ROLLED_BACK], queue=stack.queue)])
            await conn.rollback()

    run(scenario())
    stack.only_committed_delivered()


def test_psycopg_async_cursor(stack: StackRig) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(stack.dsn) as conn:
            async with conn.cursor() as cursor:
                await drain.astage(cursor, tasks.record, args=[COMMITTED], queue=stack.queue)
                await asyncio.to_thread(stack.drain_sees_nothing)
            await conn.commit()
            async with conn.cursor() as cursor:
                await drain.astage(cursor, tasks.record, args=[ROLLED_BACK], queue=stack.queue)
            await conn.rollback()

    run(scenario())
    stack.only_committed_delivered()


def test_sqlalchemy_async_session(stack: StackRig) -> None:
    async def scenario() -> None:
        engine = create_async_engine(stack.dsn.replace("postgresql://", "postgresql+psycopg://", 1))
        try:
            async with AsyncSession(engine) as session, session.begin():
                await session.execute(sqlalchemy.text("SELECT 1"))
                await drain.astage(session, tasks.record, args=[COMMITTED], queue=stack.queue)
                await asyncio.to_thread(stack.drain_sees_nothing)
            async with AsyncSession(engine) as session:
                await drain.astage(session, tasks.record, args=[ROLLED_BACK], queue=stack.queue)
                await session.rollback()
            async with engine.connect() as conn:  # an AsyncConnection too
                staged = await drain.astage(conn, "app.tasks.x", on_conflict="ignore")
                assert staged.staged
                await conn.rollback()
        finally:
            await engine.dispose()

    run(scenario())
    stack.only_committed_delivered()


def test_sync_stage_refuses_an_async_connection_at_once(database: str) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(database) as conn:
            with pytest.raises(drain.StagingError, match="astage"):
                drain.stage(conn, "app.tasks.a")
            with pytest.raises(drain.StagingError, match="astage"):
                drain.stage_many(conn, [drain.Job("app.tasks.a")])
            async with conn.cursor() as cursor:
                with pytest.raises(drain.StagingError, match="astage"):
                    drain.stage(cursor, "app.tasks.a")
            await conn.commit()
        engine = create_async_engine(database.replace("postgresql://", "postgresql+psycopg://", 1))
        async with AsyncSession(engine) as session:
            with pytest.raises(drain.StagingError, match="astage"):
                drain.stage(session, "app.tasks.a")
            await session.commit()
        await engine.dispose()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine was never awaited" would be an error here
        run(scenario())
    assert count(database) == 0


def test_astage_refuses_a_sync_connection(database: str) -> None:
    with psycopg.connect(database) as conn:
        with pytest.raises(drain.StagingError, match="without await"):
            run(drain.astage(conn, "app.tasks.a"))
        conn.rollback()


def test_async_autocommit_warns(database: str) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(database, autocommit=True) as conn:
            with pytest.warns(drain.AutocommitWarning):
                await drain.astage(conn, "app.tasks.a")

    run(scenario())
    assert count(database) == 1
