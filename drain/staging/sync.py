"""stage() and stage_many(): insert job rows on the caller's connection, inside its transaction.

They never commit and never open a transaction of their own: the job becomes visible to the
drain when, and only if, the caller's transaction commits. Every argument is checked before
anything is sent (:mod:`drain.staging.rows`), so a bad job raises StagingError and leaves the
transaction usable. The connection kinds accepted are listed in :mod:`drain.staging.conn`; the
asyncio versions are :func:`drain.astage` and :func:`drain.astage_many`.

Idempotency: a caller-chosen ``job_id`` is unique *while the job is staged* (from its commit
until the drain forwards or dead-letters it). ``on_conflict="ignore"`` turns "already staged"
into a :class:`Staged` result with ``staged=False`` instead of a unique-violation error (which
would abort the caller's transaction). Once the row has been forwarded the id is free again:
staging it anew makes a new job.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, overload

from drain import errors, models
from drain.staging import rows as staging_rows
from drain.staging.conn import execute
from drain.staging.rows import Job, JobName, job_from, keyed, row, row_json
from drain.store import sql

__all__ = ["Job", "Staged", "stage", "stage_many"]

OnConflict = Literal["ignore"]
# One statement carries at most this much JSON; more jobs go in further statements of the same
# transaction (Postgres refuses a jsonb value past 256 MiB).
MAX_STATEMENT_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Staged:
    """What ``on_conflict="ignore"`` returns: the job id, and whether this call inserted it
    (False: a job with this id was already staged, and nothing was inserted)."""

    job_id: uuid.UUID
    staged: bool


@overload
def stage(
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
def stage(
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
def stage(
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
    """Stage one job in the caller's current transaction and return its job id.

    ``job_name`` is a dotted name or a module-level function (staged as ``module.qualname``).
    ``run_at`` (timezone-aware) or ``delay`` (seconds or a timedelta, counted by the database
    clock from the transaction's start) defers the job. ``job_id`` lets the app choose the
    idempotency key; a UUID is generated otherwise. ``ordering_key`` (None, or a string of 1 to
    255 bytes of UTF-8, not blank) puts the job in order behind the committed jobs of the table staged
    earlier with the same key: the drain forwards it only once they are gone (docs/staging.md,
    "Per-key order"). With ``on_conflict="ignore"`` the result is a :class:`Staged`. Raises
    StagingError for a bad argument before touching the database.
    """
    job = Job(job_name, args, kwargs, queue, backend, run_at, delay, job_id, options, ordering_key)
    params, new_id = row(job)
    ignore = wants_ignore(on_conflict)
    which = SINGLE_STATEMENT[ignore, keyed(params)]
    rows = execute(conn, statement(which, schema, table), params, returning=ignore)
    if not ignore:
        return new_id
    return Staged(new_id, staged=bool(rows))


@overload
def stage_many(
    conn: Any,
    jobs: Iterable[Job | Mapping[str, Any]],
    *,
    on_conflict: None = ...,
    table: str = ...,
    schema: str = ...,
) -> list[uuid.UUID]: ...
@overload
def stage_many(
    conn: Any,
    jobs: Iterable[Job | Mapping[str, Any]],
    *,
    on_conflict: OnConflict,
    table: str = ...,
    schema: str = ...,
) -> list[Staged]: ...
def stage_many(
    conn: Any,
    jobs: Iterable[Job | Mapping[str, Any]],
    *,
    on_conflict: OnConflict | None = None,
    table: str = models.DEFAULT_TABLE,
    schema: str = models.DEFAULT_SCHEMA,
) -> list[uuid.UUID] | list[Staged]:
    """Stage many jobs with one statement (one round trip); return their job ids in order.

    Each item is a :class:`Job` or a mapping with the same keys. Every job is validated first;
    one bad job raises StagingError naming its position, and nothing is inserted. Two jobs with
    the same ``job_id`` are refused, or with ``on_conflict="ignore"`` the first one is staged.
    The jobs are staged in the list's order, so jobs with one ``ordering_key`` keep it.
    """
    ignore = wants_ignore(on_conflict)
    ids, chunks = prepare_many(jobs, ignore)
    inserted: set[uuid.UUID] = set()
    for chunk in chunks:
        text = statement(MANY_STATEMENT[ignore, chunk.keyed], schema, table)
        rows = execute(conn, text, {"jobs": chunk.jobs}, returning=ignore)
        inserted.update(uuid.UUID(str(found[0])) for found in rows)
    if not ignore:
        return ids
    return staged_results(ids, inserted)


# The statement for (on_conflict="ignore", keyed): ``(name, file)``.
SINGLE_STATEMENT = {
    (False, False): ("insert_job", "queries.sql"),
    (True, False): ("insert_job_if_absent", "staging.sql"),
    (False, True): ("insert_keyed_job", "staging.sql"),
    (True, True): ("insert_keyed_job_if_absent", "staging.sql"),
}
MANY_STATEMENT = {
    (False, False): ("insert_jobs", "queries.sql"),
    (True, False): ("insert_jobs_if_absent", "staging.sql"),
    (False, True): ("insert_keyed_jobs", "staging.sql"),
    (True, True): ("insert_keyed_jobs_if_absent", "staging.sql"),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """The rows of one statement of stage_many: a JSON array, and whether a row has a key."""

    jobs: str
    keyed: bool


def wants_ignore(on_conflict: Any) -> bool:
    if on_conflict is None:
        return False
    if on_conflict == "ignore":
        return True
    raise errors.StagingError(f'on_conflict must be None or "ignore", not {staging_rows.show(on_conflict)}')


def prepare_many(
    jobs: Iterable[Job | Mapping[str, Any]], ignore: bool
) -> tuple[list[uuid.UUID], list[Chunk]]:
    """Validate every job; return their ids in order and the rows to send (usually one chunk)."""
    if isinstance(jobs, (str, bytes, Mapping)):
        raise errors.StagingError(f"jobs must be an iterable of jobs, not {type(jobs).__name__}")
    ids: list[uuid.UUID] = []
    first_at: dict[uuid.UUID, int] = {}
    chunks: list[Chunk] = []
    pieces: list[str] = []
    size = 0
    any_key = False
    for position, item in enumerate(jobs):
        try:
            params, job_id = row(job_from(item))
        except errors.StagingError as exc:
            raise errors.StagingError(f"job {position}: {exc}") from None
        if job_id in first_at and not ignore:
            raise errors.StagingError(
                f"job {position}: job_id {job_id} repeats job {first_at[job_id]}'s "
                '(pass on_conflict="ignore" to stage the first only)'
            )
        first_at.setdefault(job_id, position)
        ids.append(job_id)
        piece = row_json(params)
        if pieces and size + len(piece) > MAX_STATEMENT_BYTES:
            chunks.append(Chunk(f"[{','.join(pieces)}]", any_key))
            pieces, size, any_key = [], 0, False
        pieces.append(piece)
        size += len(piece) + 1
        any_key = any_key or keyed(params)
    if pieces:
        chunks.append(Chunk(f"[{','.join(pieces)}]", any_key))
    return ids, chunks


def staged_results(ids: list[uuid.UUID], inserted: set[uuid.UUID]) -> list[Staged]:
    """One Staged per job, in order; of repeated ids only the first occurrence counts as staged."""
    results = []
    for job_id in ids:
        results.append(Staged(job_id, staged=job_id in inserted))
        inserted.discard(job_id)
    return results


@functools.cache
def statement(which: tuple[str, str], schema: str, table: str) -> str:
    """The text of a staging statement for this table (``(name, file)``), composed once."""
    name, filename = which
    text: str = sql.query(name, sql.Names(schema, table), filename).as_string(None)
    return text
