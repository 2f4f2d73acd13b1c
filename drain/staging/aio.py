"""astage() and astage_many(): stage() and stage_many() for asyncio apps.

Accepted: a psycopg 3 ``AsyncConnection`` or ``AsyncCursor``, a SQLAlchemy 2 ``AsyncConnection``
or ``AsyncSession`` on the psycopg driver (``postgresql+psycopg://``). Same rules as the sync
API: the caller's transaction, never a commit, every argument checked before anything is sent,
the same return values (:class:`drain.Staged` with ``on_conflict="ignore"``).
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, overload

from drain import errors, models
from drain.staging.conn import is_async, require_pyformat, warn_if_autocommit
from drain.staging.rows import Job, JobName, keyed, row
from drain.staging.sync import (
    MANY_STATEMENT,
    SINGLE_STATEMENT,
    OnConflict,
    Staged,
    prepare_many,
    staged_results,
    statement,
    wants_ignore,
)

__all__ = ["astage", "astage_many"]


@overload
async def astage(
    conn: Any,
    job_name: JobName,
    *,
    args: Sequence[Any] = ...,
    kwargs: Mapping[str, Any] | None = ...,
    queue: str = ...,
    backend: str = ...,
    run_at: datetime.datetime | None = ...,
    delay: datetime.timedelta | float | None = ...,
    job_id: uuid.UUID | str | None = ...,
    options: Mapping[str, Any] | None = ...,
    ordering_key: str | None = ...,
    on_conflict: None = ...,
    table: str = ...,
    schema: str = ...,
) -> uuid.UUID: ...
@overload
async def astage(
    conn: Any,
    job_name: JobName,
    *,
    args: Sequence[Any] = ...,
    kwargs: Mapping[str, Any] | None = ...,
    queue: str = ...,
    backend: str = ...,
    run_at: datetime.datetime | None = ...,
    delay: datetime.timedelta | float | None = ...,
    job_id: uuid.UUID | str | None = ...,
    options: Mapping[str, Any] | None = ...,
    ordering_key: str | None = ...,
    on_conflict: OnConflict,
    table: str = ...,
    schema: str = ...,
) -> Staged: ...
async def astage(
    conn: Any,
    job_name: JobName,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    queue: str = "default",
    backend: str = "default",
    run_at: datetime.datetime | None = None,
    delay: datetime.timedelta | float | None = None,
    job_id: uuid.UUID | str | None = None,
    options: Mapping[str, Any] | None = None,
    ordering_key: str | None = None,
    on_conflict: OnConflict | None = None,
    table: str = models.DEFAULT_TABLE,
    schema: str = models.DEFAULT_SCHEMA,
) -> uuid.UUID | Staged:
    """Stage one job in the caller's current transaction: :func:`drain.stage`, awaited."""
    job = Job(job_name, args, kwargs, queue, backend, run_at, delay, job_id, options, ordering_key)
    params, new_id = row(job)
    ignore = wants_ignore(on_conflict)
    which = SINGLE_STATEMENT[ignore, keyed(params)]
    rows = await _execute(conn, statement(which, schema, table), params, ignore)
    if not ignore:
        return new_id
    return Staged(new_id, staged=bool(rows))


@overload
async def astage_many(
    conn: Any,
    jobs: Iterable[Job | Mapping[str, Any]],
    *,
    on_conflict: None = ...,
    table: str = ...,
    schema: str = ...,
) -> list[uuid.UUID]: ...
@overload
async def astage_many(
    conn: Any,
    jobs: Iterable[Job | Mapping[str, Any]],
    *,
    on_conflict: OnConflict,
    table: str = ...,
    schema: str = ...,
) -> list[Staged]: ...
async def astage_many(
    conn: Any,
    jobs: Iterable[Job | Mapping[str, Any]],
    *,
    on_conflict: OnConflict | None = None,
    table: str = models.DEFAULT_TABLE,
    schema: str = models.DEFAULT_SCHEMA,
) -> list[uuid.UUID] | list[Staged]:
    """Stage many jobs in one statement: :func:`drain.stage_many`, awaited."""
    ignore = wants_ignore(on_conflict)
    ids, chunks = prepare_many(jobs, ignore)
    inserted: set[uuid.UUID] = set()
    for chunk in chunks:
        text = statement(MANY_STATEMENT[ignore, chunk.keyed], schema, table)
        rows = await _execute(conn, text, {"jobs": chunk.jobs}, ignore)
        inserted.update(uuid.UUID(str(found[0])) for found in rows)
    if not ignore:
        return ids
    return staged_results(ids, inserted)


async def _execute(conn: Any, text: str, params: Mapping[str, Any], returning: bool) -> list[Sequence[Any]]:
    if not is_async(type(conn)):
        raise errors.StagingError(
            f"{type(conn).__name__} is not an asyncio connection: use drain.stage(...) without await"
        )
    if hasattr(conn, "get_bind") and hasattr(conn, "sync_session"):  # SQLAlchemy AsyncSession
        conn = await conn.connection()
    if hasattr(conn, "exec_driver_sql"):  # SQLAlchemy AsyncConnection
        require_pyformat(conn.dialect)
        warn_if_autocommit(conn.sync_connection.connection.driver_connection, stacklevel=3)
        result = await conn.exec_driver_sql(text, dict(params))
        return list(result.fetchall()) if returning else []
    if hasattr(conn, "fetchall"):  # psycopg AsyncCursor
        warn_if_autocommit(conn.connection, stacklevel=3)
        await conn.execute(text, params)
        return list(await conn.fetchall()) if returning else []
    if hasattr(conn, "cursor"):  # psycopg AsyncConnection
        warn_if_autocommit(conn, stacklevel=3)
        cursor = await conn.execute(text, params)
        return list(await cursor.fetchall()) if returning else []
    raise errors.StagingError(f"cannot stage on a {type(conn).__name__}: not a supported asyncio connection")
