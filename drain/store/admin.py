"""The CLI's queries: status figures, dead letters (list, retry, purge), the leader, schedules.

None of them is fenced: an operator's command reads and writes on its own session, whether or
not a drain leads (drain.store.session holds the relay's fenced one).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from typing import Any, NamedTuple

import psycopg
from psycopg import rows
from psycopg.types import datetime as pg_datetime
from psycopg.types import json as pg_json

from drain.store import connection, migrations, sql, ticks, writes


class Admin:
    """The CLI's queries, on the connection it is given (the CLI's: drain.store.session.Store.conn)."""

    def __init__(self, conn: psycopg.Connection[Any], names: sql.Names) -> None:
        self._conn = conn
        self._names = names

    def schedules(self) -> tuple[list[dict[str, Any]], datetime.datetime]:
        """Every recorded schedule (name, cron, timezone, last_tick, last_job_id), and the
        database's now (drain.relay.schedules.listing)."""
        with self._conn.cursor(row_factory=rows.dict_row) as cursor:
            cursor.execute(sql.query("schedule_list", self._names))
            recorded = cursor.fetchall()
        return recorded, ticks.now(self._conn, self._names)

    def not_valid_constraints(self) -> list[str]:
        """The table's constraints still NOT VALID: rows in it break them."""
        found = self._conn.execute(migrations.statement("not_valid", self._names)).fetchall()
        return [str(row[0]) for row in found]

    def parked(self) -> int:
        """How many rows are parked: run_at PARKED_AT and last_error PARKED_PREFIX (Batch.park),
        or parked in place, among the due rows (Batch.park_in_place)."""
        params = {"parked_at": writes.PARKED_AT, "prefix": writes.PARKED_PREFIX}
        row = self._conn.execute(sql.query("parked_count", self._names), params).fetchone()
        return int(row[0]) if row else 0

    def drains(self) -> list[str]:
        """The application names of the drain sessions connected to this database."""
        with self._conn.cursor() as cursor:
            cursor.execute(sql.query("drains", self._names))
            return [str(row[0]) for row in cursor.fetchall()]

    def leader(self, key: int) -> dict[str, Any] | None:
        """Who holds the leader lock: pid, application_name, client_addr, backend_start."""
        classid, objid = connection.split_key(key)
        with self._conn.cursor(row_factory=rows.dict_row) as cursor:
            cursor.execute(sql.query("leader", self._names), {"classid": classid, "objid": objid})
            return cursor.fetchone()

    # --- dead letters ---------------------------------------------------------------------

    def dead_list(self, filters: DeadFilter) -> list[dict[str, Any]]:
        """Dead letters matching ``filters``, oldest first. A value Python cannot hold (JSON too
        deep or with too long a number, a timestamp out of ``datetime``'s range: often the very
        reason the row died) comes as its text instead."""
        with self._conn.cursor(row_factory=rows.dict_row) as cursor:
            cursor.adapters.register_loader("jsonb", _LenientJsonbLoader)
            cursor.adapters.register_loader("timestamptz", _LenientTimestamptzLoader)
            if self._conn.info.encoding == "ascii":  # a SQL_ASCII database: names may not be UTF-8
                for name in connection.TEXT_TYPES:
                    cursor.adapters.register_loader(name, connection.LenientTextLoader)
            cursor.execute(sql.query("dead_list", self._names), filters.params())
            return cursor.fetchall()

    def dead_retry(self, filters: DeadFilter) -> Retried:
        """Move matching dead letters back to the table; return how many moved and how many the
        table refused.

        Each gets a new row id (a keyed one its own back: queries.sql dead_retry), keeps its
        job_id, and is due now with attempts reset. A dead
        letter whose job_id is staged again already stays where it is. All in one transaction,
        unless a dead letter breaks one of the table's constraints (one buried by `drain
        migrate`, or before the table had them): then one at a time, newest first (as the single
        statement prefers the newest of a job_id), and those the table refuses stay dead.
        """
        try:
            with self._conn.transaction(), self._conn.cursor() as cursor:
                cursor.execute(sql.query("dead_retry", self._names), self._retry_params(filters))
                return Retried(len(cursor.fetchall()), 0)
        except REFUSED_BY_TABLE:
            pass
        with self._conn.cursor() as cursor:
            cursor.execute(sql.query("dead_ids", self._names), filters.params())
            ids = [int(row[0]) for row in cursor.fetchall()]
        moved = refused = 0
        for dead_id in ids:
            try:
                with self._conn.transaction(), self._conn.cursor() as cursor:
                    cursor.execute(
                        sql.query("dead_retry", self._names), self._retry_params(DeadFilter(ids=[dead_id]))
                    )
                    moved += len(cursor.fetchall())
            except REFUSED_BY_TABLE:
                refused += 1
        return Retried(moved, refused)

    def _retry_params(self, filters: DeadFilter) -> dict[str, Any]:
        return {**filters.params(), "qualified": self._names.qualified}

    def dead_purge(self, filters: DeadFilter) -> int:
        """Delete matching dead letters; return how many.

        A keyed dead letter may hold the rows of its key (block_on_dead_letter): its purge then
        wakes a sleeping leader at commit (the wake_due statement), as a producer's INSERT does.
        A role that may not update the table purges all the same; the leader finds those rows at
        its next poll.
        """
        with self._conn.transaction(), self._conn.cursor() as cursor:
            cursor.execute(sql.query("dead_purge", self._names), filters.params())
            purged = cursor.fetchall()
            if any(key is not None for _, key in purged):
                try:
                    with self._conn.transaction():
                        cursor.execute(sql.query("wake_due", self._names))
                except psycopg.errors.InsufficientPrivilege:
                    pass
            return len(purged)


class Retried(NamedTuple):
    """What `drain dead retry` did: dead letters staged again, and those the table refused."""

    moved: int
    refused: int


@dataclasses.dataclass(frozen=True)
class DeadFilter:
    """Which dead letters a command applies to; None matches everything."""

    backend: str | None = None
    queue: str | None = None
    job_name: str | None = None
    ids: Sequence[int] | None = None
    limit: int | None = None

    @property
    def everything(self) -> bool:
        return self.backend is None and self.queue is None and self.job_name is None and not self.ids

    def params(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "queue": self.queue,
            "job_name": self.job_name,
            "ids": list(self.ids) if self.ids else None,
            "limit": self.limit,
        }


REFUSED_BY_TABLE = (psycopg.errors.InvalidParameterValue, psycopg.errors.CheckViolation)


class _LenientJsonbLoader(pg_json.JsonbLoader):
    """jsonb as its value, or as its text when Python cannot decode it."""

    def load(self, data: Any) -> Any:
        try:
            return super().load(data)
        except (ValueError, RecursionError):
            return bytes(data).decode("utf-8", "replace")


class _LenientTimestamptzLoader(pg_datetime.TimestamptzLoader):
    """timestamptz as a datetime, or as its text when ``datetime`` cannot hold it."""

    def load(self, data: Any) -> Any:
        try:
            return super().load(data)
        except psycopg.DataError:
            return bytes(data).decode("utf-8", "replace")
