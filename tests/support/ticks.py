"""What the schedule tests count: every job row INSERTed into ``staged_jobs`` for a schedule tick.

A trigger on the staged-jobs table copies each scheduled job (options carrying the reserved
``drain_schedule``, drain.models.SCHEDULE_OPTION) into ``tick_log`` in the inserting transaction,
with the inserting session's backend pid and the transaction's database clock. A pass that
rolled back leaves no row, so ``tick_log`` holds exactly the ticks that were staged
(committed), however soon they were forwarded and deleted.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import itertools
from typing import Any

import psycopg

SCHEMA = """
CREATE TABLE IF NOT EXISTS tick_log (
    schedule  text        NOT NULL,
    tick      timestamptz NOT NULL,
    job_id    uuid        NOT NULL,
    pid       int         NOT NULL,
    staged_at timestamptz NOT NULL
);
CREATE OR REPLACE FUNCTION log_tick() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.options ? 'drain_schedule' THEN
        INSERT INTO tick_log VALUES (
            NEW.options ->> 'drain_schedule', NEW.run_at, NEW.job_id, pg_backend_pid(), now()
        );
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS log_tick ON staged_jobs;
CREATE TRIGGER log_tick AFTER INSERT ON staged_jobs FOR EACH ROW EXECUTE FUNCTION log_tick();
"""


def install(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)


@dataclasses.dataclass(frozen=True)
class Staged:
    schedule: str
    tick: datetime.datetime
    job_id: str
    pid: int
    staged_at: datetime.datetime


def staged(dsn: str, schedule: str | None = None) -> list[Staged]:
    """The staged ticks (of one schedule, or all), in staging order."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            "SELECT schedule, tick, job_id::text, pid, staged_at FROM tick_log "
            "WHERE %(schedule)s::text IS NULL OR schedule = %(schedule)s ORDER BY staged_at, tick",
            {"schedule": schedule},
        ).fetchall()
    return [Staged(*row) for row in found]


def duplicates(rows: list[Staged]) -> dict[tuple[str, datetime.datetime], int]:
    counts = collections.Counter((row.schedule, row.tick) for row in rows)
    return {key: count for key, count in counts.items() if count > 1}


def gaps(ticks: list[datetime.datetime], every_s: float = 1.0) -> list[tuple[datetime.datetime, int]]:
    """Where a series of ticks every ``every_s`` misses ticks: (tick before the gap, how many)."""
    ordered = sorted(set(ticks))
    found = []
    for before, after in itertools.pairwise(ordered):
        missing = round((after - before).total_seconds() / every_s) - 1
        if missing:
            found.append((before, missing))
    return found


def db_now(dsn: str) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]
