"""stage() and stage_many(): insert job rows on the caller's connection, inside its transaction.

They never commit and never open a transaction of their own: the job becomes visible to the
drain when, and only if, the caller's transaction commits. Every argument is checked before
anything is sent, so a bad job raises StagingError and leaves the transaction usable.

Accepted connections: a psycopg 3 connection or cursor, a psycopg2 connection or cursor, a
SQLAlchemy ``Connection`` or ``Session``, a Django connection. All are driven with the same
statement text and ``%(name)s`` parameters, so no driver is imported here.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from drain import config, errors, sql

MAX_PAYLOAD_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """A job to stage with :func:`stage_many`; the fields mean what :func:`stage`'s arguments do."""

    job_name: str
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] | None = None
    queue: str = "default"
    backend: str = "default"
    run_at: datetime.datetime | None = None
    delay: datetime.timedelta | float | None = None
    job_id: uuid.UUID | str | None = None
    options: Mapping[str, Any] | None = None


def stage(
    conn: Any,
    job_name: str,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    queue: str = "default",
    backend: str = "default",
    run_at: datetime.datetime | None = None,
    delay: datetime.timedelta | float | None = None,
    job_id: uuid.UUID | str | None = None,
    options: Mapping[str, Any] | None = None,
    table: str = config.DEFAULT_TABLE,
    schema: str = config.DEFAULT_SCHEMA,
) -> uuid.UUID:
    """Stage one job in the caller's current transaction and return its job id.

    ``run_at`` (timezone-aware) or ``delay`` (seconds or a timedelta, counted by the database
    clock from the transaction's start) defers the job. ``job_id`` lets the app choose the
    idempotency key; a UUID is generated otherwise. Raises StagingError for a bad argument
    before touching the database.
    """
    job = Job(job_name, args, kwargs, queue, backend, run_at, delay, job_id, options)
    params = _row(job)
    _execute(conn, _statement("insert_job", schema, table), params)
    return uuid.UUID(params["job_id"])


def stage_many(
    conn: Any,
    jobs: Iterable[Job | Mapping[str, Any]],
    *,
    table: str = config.DEFAULT_TABLE,
    schema: str = config.DEFAULT_SCHEMA,
) -> list[uuid.UUID]:
    """Stage many jobs with one statement (one round trip); return their job ids in order.

    Each item is a :class:`Job` or a mapping with the same keys. Every job is validated first;
    one bad job raises StagingError naming its position, and nothing is inserted.
    """
    rows = []
    for position, item in enumerate(jobs):
        try:
            job = item if isinstance(item, Job) else Job(**item)
        except TypeError as exc:
            raise errors.StagingError(f"job {position}: {exc}") from None
        try:
            rows.append(_row(job))
        except errors.StagingError as exc:
            raise errors.StagingError(f"job {position}: {exc}") from None
    if not rows:
        return []
    payload = [
        {
            **row,
            "job_args": json.loads(row["job_args"]),
            "job_kwargs": json.loads(row["job_kwargs"]),
            "options": json.loads(row["options"]),
            "run_at": row["run_at"].isoformat() if row["run_at"] else None,
        }
        for row in rows
    ]
    _execute(conn, _statement("insert_jobs", schema, table), {"jobs": json.dumps(payload)})
    return [uuid.UUID(row["job_id"]) for row in rows]


def _dump(value: Any, what: str) -> str:
    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise errors.StagingError(f"{what} must be JSON-serialisable: {exc}") from None
    if len(text) > MAX_PAYLOAD_BYTES:
        raise errors.StagingError(f"{what} is {len(text)} bytes; the limit is {MAX_PAYLOAD_BYTES}")
    return text


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise errors.StagingError(f"{what} must be a non-empty string, not {value!r}")
    return value


def _row(job: Job) -> dict[str, Any]:
    _name(job.job_name, "job_name")
    if isinstance(job.args, (str, bytes, Mapping)) or not isinstance(job.args, Sequence):
        raise errors.StagingError(f"args must be a list or tuple, not {type(job.args).__name__}")
    kwargs = {} if job.kwargs is None else job.kwargs
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise errors.StagingError("kwargs must be a mapping with string keys")
    options = {} if job.options is None else job.options
    if not isinstance(options, Mapping) or not all(isinstance(key, str) for key in options):
        raise errors.StagingError("options must be a mapping with string keys")
    if job.run_at is not None and job.delay is not None:
        raise errors.StagingError("give run_at or delay, not both")
    if job.run_at is not None:
        if not isinstance(job.run_at, datetime.datetime):
            raise errors.StagingError(f"run_at must be a datetime, not {type(job.run_at).__name__}")
        if job.run_at.tzinfo is None or job.run_at.utcoffset() is None:
            raise errors.StagingError("run_at must be timezone-aware (a naive datetime is ambiguous)")
    return {
        "job_name": job.job_name,
        "job_args": _dump(list(job.args), "args"),
        "job_kwargs": _dump(dict(kwargs), "kwargs"),
        "queue": _name(job.queue, "queue"),
        "backend": _name(job.backend, "backend"),
        "job_id": str(_job_id(job.job_id)),
        "run_at": job.run_at,
        "delay_s": _delay_seconds(job.delay),
        "options": _dump(dict(options), "options"),
    }


def _job_id(value: uuid.UUID | str | None) -> uuid.UUID:
    if value is None:
        return uuid.uuid4()
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise errors.StagingError(f"job_id must be a UUID, not {value!r}") from None


def _delay_seconds(delay: datetime.timedelta | float | None) -> float | None:
    if delay is None:
        return None
    seconds = delay.total_seconds() if isinstance(delay, datetime.timedelta) else delay
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        raise errors.StagingError(f"delay must be seconds or a timedelta, not {delay!r}")
    if seconds < 0:
        raise errors.StagingError(f"delay must not be negative, not {seconds}")
    return float(seconds)


@functools.cache
def _statement(name: str, schema: str, table: str) -> str:
    names = sql.Names(schema, table)
    text: str = sql.query(name, names).as_string(None)
    return text


def _execute(conn: Any, statement: str, params: Mapping[str, Any]) -> None:
    """Run one statement on whatever kind of connection or cursor the app handed us."""
    if hasattr(conn, "exec_driver_sql"):  # SQLAlchemy Connection
        conn.exec_driver_sql(statement, dict(params))
    elif hasattr(conn, "get_bind") and hasattr(conn, "connection"):  # SQLAlchemy Session
        conn.connection().exec_driver_sql(statement, dict(params))
    elif hasattr(conn, "execute"):  # psycopg 3 connection or cursor, psycopg2 cursor
        conn.execute(statement, params)
    elif hasattr(conn, "cursor"):  # psycopg2 or Django connection
        cursor = conn.cursor()
        try:
            cursor.execute(statement, params)
        finally:
            cursor.close()
    else:
        raise errors.StagingError(f"cannot stage on a {type(conn).__name__}: not a database connection")
