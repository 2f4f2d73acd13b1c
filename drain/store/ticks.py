"""The statements of a schedule's pass (drain.relay.schedules), in the leader's fenced
transaction: read the database clock and the schedules' last ticks (locked), stage the ticks'
jobs, tell which staged rows holding a tick's job id are that very tick, advance the last ticks
by compare-and-set."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg import rows

from drain.store import sql


class Ticks:
    """A pass's statements on the batch transaction's connection (drain.store.session.Batch.ticks)."""

    def __init__(self, conn: psycopg.Connection[Any], names: sql.Names) -> None:
        self._conn = conn
        self._names = names

    def now(self) -> datetime.datetime:
        """The database clock, the one every schedule is evaluated against (never the drain's)."""
        return now(self._conn, self._names)

    def last_ticks(self, schedules: Sequence[str]) -> dict[str, datetime.datetime | None]:
        """The last tick of each of these schedules that has a row, by name; their rows locked."""
        with self._conn.cursor(row_factory=rows.dict_row) as cursor:
            cursor.execute(sql.query("schedule_ticks", self._names), {"names": list(schedules)})
            return {row["name"]: row["last_tick"] for row in cursor.fetchall()}

    def stage(self, jobs: Sequence[Mapping[str, Any]]) -> set[str]:
        """INSERT the jobs (JSON values: job_name, job_args, job_kwargs, queue, backend, job_id,
        run_at, options); return the job ids inserted (those a row already holds are not)."""
        if not jobs:
            return set()
        result = self._conn.execute(
            sql.query("schedule_stage", self._names), {"jobs": json.dumps(list(jobs))}
        )
        return {str(row[0]) for row in result.fetchall()}

    def same_ticks(self, held: Sequence[Mapping[str, Any]]) -> set[str]:
        """Of these jobs, whose job id a staged row holds, the job ids whose row is that very tick
        (``schedule_tick_rows``)."""
        if not held:
            return set()
        result = self._conn.execute(
            sql.query("schedule_tick_rows", self._names), {"jobs": json.dumps(list(held))}
        )
        return {str(row[0]) for row in result.fetchall()}

    def advance(self, advance: Mapping[str, Any]) -> bool:
        """Record a schedule's new last tick (name, cron, timezone, last_tick, last_job_id) if it
        still is ``previous``; False when another session moved it."""
        return self._conn.execute(sql.query("schedule_advance", self._names), advance).fetchone() is not None


def now(conn: psycopg.Connection[Any], names: sql.Names) -> datetime.datetime:
    """The database clock."""
    row = conn.execute(sql.query("schedule_now", names)).fetchone()
    assert row is not None and isinstance(row[0], datetime.datetime)
    return row[0]
