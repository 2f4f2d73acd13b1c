"""Periodic jobs: the leader stages each tick of every ``[[schedules]]`` entry exactly once.

A pass is one fenced transaction on the leader's session (the batch's REPEATABLE READ
transaction, which first verifies the lock)::

    BEGIN REPEATABLE READ; verify the lock
    now := the database clock (never the drain's: clocks skew)
    lock the schedules' rows in <table>_schedules (FOR UPDATE)
    for each schedule: the ticks in (last_tick, now], cut by catch_up; one job per tick
    INSERT the jobs (run_at = the tick); UPDATE last_tick WHERE it is still what was read
    COMMIT

The job and the new last tick commit together or not at all, so a tick is staged once across
restarts, failovers and a leader killed mid-pass; a second writer of the same rows makes the
transaction fail (serialization error, or the compare-and-set finding no row) rather than stage
twice. Each tick's job id is ``uuid5(schedule, tick)``: the key a consumer dedupes on, the same
on every backend. That id can be computed by anyone, so a producer can stage a row under it
first: a row holding it that is this very tick (the same job, due at the tick or backing off) is
the tick, staged once; any other row is not, and the tick is staged under a fresh random id, with
a warning (``schedule_tick_id_taken``) that names both ids and nothing of that row.

Catch-up: a leader stages every tick that falls due during its term. The ticks that fell due
before its term began (no drain was leading, or the schedule is new) follow the schedule's
``catch_up``: ``all`` stages the ``catch_up_max`` most recent, ``latest`` the most recent one,
``none`` skips them. A schedule seen for the first time starts at the database's now: its first
job is its next tick. A schedule removed from the config is no longer read or written; its row
stays for ``drain schedules`` to show, and it resumes from that row if it comes back.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import rows

from drain import errors
from drain.config import cron
from drain.config import settings as config
from drain.relay import leadership
from drain.store import session as store
from drain.store import sql

log = logging.getLogger(__name__)

# Pinned (tests/unit/test_schedules.py): a tick's job id must not change across versions.
TICK_NAMESPACE = uuid.UUID("5b0c2b6e-5d7a-4a53-9a43-0d1f1c6f2e61")
MIN_PASS_INTERVAL_S = 0.01  # never two passes closer than this, however near the next tick
RECHECK_S = 60.0  # the longest time between passes, even with no tick near
META_SCHEDULE = "drain_schedule"
META_TICK = "drain_tick"
# Where each backend type passes the schedule's name and tick on to the consumer, besides the
# job id: RQ's job.meta, AMQP message headers. Other types carry the job id only.
METADATA_OPTION: Mapping[str, str] = {"rq": "meta", "rabbitmq": "headers", "memory": "meta"}


def tick_job_id(names: sql.Names, schedule: str, tick: datetime.datetime) -> uuid.UUID:
    """The job id of one tick: the same for the same table, schedule and instant, whoever stages it."""
    instant = tick.astimezone(datetime.UTC).isoformat()
    return uuid.uuid5(TICK_NAMESPACE, f"{names.qualified}\x00{schedule}\x00{instant}")


def tick_options(
    schedule: config.ScheduleSettings, backend_type: str | None, tick: datetime.datetime
) -> dict[str, Any]:
    """The schedule's options with its name and tick added where the backend passes them on."""
    options = dict(schedule.options)
    key = METADATA_OPTION.get(backend_type or "")
    if key is not None:
        existing = options.get(key)
        if existing is None or isinstance(existing, dict):
            options[key] = {
                **(existing or {}),
                META_SCHEDULE: schedule.name,
                META_TICK: tick.astimezone(datetime.UTC).isoformat(),
            }
    return options


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one pass does for one schedule: the ticks to stage and the new last tick."""

    ticks: list[datetime.datetime]
    last_tick: datetime.datetime | None  # None: leave the row as it is
    skipped: bool = False


def plan(
    schedule: config.ScheduleSettings,
    last_tick: datetime.datetime | None,
    now: datetime.datetime,
    *,
    term_start: bool,
) -> Plan:
    """The ticks of ``schedule`` to stage at database time ``now`` (pure; no I/O).

    ``term_start``: the ticks before ``now`` fell due while no drain was leading, so the
    schedule's catch_up applies to them; otherwise every tick since ``last_tick`` is staged
    (at most ``catch_up_max``, the most recent).
    """
    if last_tick is None:
        return Plan([], now)
    if not term_start or schedule.catch_up == "all":
        limit = schedule.catch_up_max
    else:
        limit = 1 if schedule.catch_up == "latest" else 0
    ticks, skipped = cron.parse(schedule.cron, schedule.timezone).recent(last_tick, now, limit)
    if ticks:
        return Plan(ticks, ticks[-1], skipped)
    return Plan([], now if skipped else None, skipped)


class Scheduler:
    """Stages the due ticks of the configured schedules; the relay calls it on its leader's turns.

    Use from the relay's thread. ``stage_due`` is cheap to call on every loop turn: it only opens
    a transaction when a tick may be due (or at least every RECHECK_S, and at once in a new term).
    """

    def __init__(
        self,
        settings: config.Settings,
        db: store.Store,
        leadership_: leadership.Leadership,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.schedules: Sequence[config.ScheduleSettings] = settings.schedules
        self._store = db
        self._leadership = leadership_
        self._clock = clock
        self._backend_types = {name: backend.type for name, backend in settings.backends.items()}
        self._term: int | None = None
        self._term_start = True
        self._next_pass = float("-inf")
        self._missing_table = False
        self._refused = False

    def wait_s(self) -> float | None:
        """Seconds until the next pass is due (for the idle wait), or None without schedules."""
        if not self.schedules:
            return None
        return max(self._next_pass - self._clock(), 0.0)

    def stage_due(self) -> int:
        """As the leader, stage every due tick in one fenced transaction; return how many jobs.

        A no-op without schedules, when no tick can be due yet, while the schedules table is
        missing, and while the drain's role may not stage or record a tick (each logged once per
        term, tried again after RECHECK_S; forwarding goes on). Other database errors and
        LeadershipLost propagate, like a batch's: nothing of the pass was committed.
        """
        if not self.schedules or self._leadership.pid is None:
            return 0
        if self._leadership.pid != self._term:
            self._term = self._leadership.pid
            self._term_start = True
            self._next_pass = float("-inf")
            self._missing_table = False
            self._refused = False
        started = self._clock()
        if started < self._next_pass:
            return 0
        if self._term_start and not self._table_present():
            self._next_pass = started + RECHECK_S
            return 0
        try:
            staged, wait_s = self._pass()
        except psycopg.errors.InsufficientPrivilege as exc:
            if not self._refused:
                reason = errors.first_line(exc)
                log.error(
                    "schedules are not staged: the drain's role may not write them (%s); grant INSERT "
                    "on the table and SELECT, INSERT, UPDATE on its schedules table",
                    reason,
                    extra={"event": "schedules_refused", "reason": reason},
                )
                self._refused = True
            self._next_pass = started + RECHECK_S
            return 0
        self._term_start = False
        self._next_pass = started + min(max(wait_s, MIN_PASS_INTERVAL_S), RECHECK_S)
        return staged

    def _table_present(self) -> bool:
        if table_present(self._store):
            return True
        if not self._missing_table:
            log.error(
                "table %s does not exist: schedules are not staged; run `drain migrate`",
                _qualified(self._store.names),
                extra={"event": "schedules_table_missing", "table": _qualified(self._store.names)},
            )
            self._missing_table = True
        return False

    def _pass(self) -> tuple[int, float]:
        """One transaction; returns (jobs staged, seconds from the database's now to the next tick)."""
        names = self._store.names
        with self._store.batch() as batch:
            self._leadership.verify(batch)
            conn = self._store.conn
            now = _now(conn, names)
            with conn.cursor(row_factory=rows.dict_row) as cursor:
                cursor.execute(
                    sql.query("schedule_ticks", names), {"names": [s.name for s in self.schedules]}
                )
                last = {row["name"]: row["last_tick"] for row in cursor.fetchall()}
            jobs: list[dict[str, Any]] = []
            advances: list[dict[str, Any]] = []
            upcoming: list[datetime.datetime] = []
            for schedule in self.schedules:
                previous = last.get(schedule.name)
                step = plan(schedule, previous, now, term_start=self._term_start)
                if step.skipped:
                    log.warning(
                        "schedule %s: ticks before %s were not staged (catch_up=%s, catch_up_max=%d)",
                        schedule.name,
                        (step.ticks[0] if step.ticks else now).isoformat(),
                        schedule.catch_up,
                        schedule.catch_up_max,
                        extra={
                            "event": "schedule_ticks_skipped",
                            "schedule": schedule.name,
                            "backend": schedule.backend,
                            "queue": schedule.queue,
                            "reason": f"catch_up={schedule.catch_up}",
                        },
                    )
                last_job_id = None
                for tick in step.ticks:
                    job_id = tick_job_id(names, schedule.name, tick)
                    jobs.append(self._job(schedule, tick, job_id))
                    last_job_id = str(job_id)
                if step.last_tick is not None:
                    advances.append(
                        {
                            "name": schedule.name,
                            "cron": schedule.cron,
                            "timezone": schedule.timezone,
                            "last_tick": step.last_tick,
                            "last_job_id": last_job_id,
                            "previous": previous,
                        }
                    )
                following = cron.parse(schedule.cron, schedule.timezone).next_after(
                    step.last_tick or previous or now
                )
                if following is not None:
                    upcoming.append(following)
            inserted = _stage(conn, names, jobs)
            renamed = _stage_taken(conn, names, [job for job in jobs if job["job_id"] not in inserted])
            inserted |= set(renamed.values())
            for advance in advances:
                advance["last_job_id"] = renamed.get(advance["last_job_id"], advance["last_job_id"])
                if conn.execute(sql.query("schedule_advance", names), advance).fetchone() is None:
                    raise errors.LeadershipLost(
                        f"schedule {advance['name']} was advanced by another session; not staging"
                    )
        for job in jobs:
            fields = {
                "backend": job["backend"],
                "queue": job["queue"],
                "job_ids": [job["job_id"]],
                "job_name": job["job_name"],
                "run_at": job["run_at"],
            }
            if job["job_id"] in renamed:
                fresh = renamed[job["job_id"]]
                log.warning(
                    "schedule tick %s: job id %s is held by a staged row that is not this tick; "
                    "staged as job %s",
                    job["run_at"],
                    job["job_id"],
                    fresh,
                    extra={
                        "event": "schedule_tick_id_taken",
                        "reason": "job_id_taken",
                        **fields,
                        "job_ids": [job["job_id"], fresh],
                    },
                )
            elif job["job_id"] in inserted:
                log.debug(
                    "schedule tick %s staged as job %s",
                    job["run_at"],
                    job["job_id"],
                    extra={"event": "schedule_tick_staged", **fields},
                )
            else:  # its job id is still staged: the same tick, so it is not staged again
                log.warning(
                    "schedule tick %s: job %s is already staged",
                    job["run_at"],
                    job["job_id"],
                    extra={"event": "schedule_tick_already_staged", "reason": "already_staged", **fields},
                )
        wait_s = min((tick - now).total_seconds() for tick in upcoming) if upcoming else RECHECK_S
        return len(inserted), wait_s

    def _job(
        self, schedule: config.ScheduleSettings, tick: datetime.datetime, job_id: uuid.UUID
    ) -> dict[str, Any]:
        return {
            "job_name": schedule.job_name,
            "job_args": list(schedule.args),
            "job_kwargs": dict(schedule.kwargs),
            "queue": schedule.queue,
            "backend": schedule.backend,
            "job_id": str(job_id),
            "run_at": tick.isoformat(),
            "options": tick_options(schedule, self._backend_types.get(schedule.backend), tick),
        }


def _stage(conn: psycopg.Connection[Any], names: sql.Names, jobs: Sequence[dict[str, Any]]) -> set[str]:
    """INSERT the jobs; return the job ids inserted (those already held by a row are not)."""
    if not jobs:
        return set()
    result = conn.execute(sql.query("schedule_stage", names), {"jobs": json.dumps(list(jobs))})
    return {str(row[0]) for row in result.fetchall()}


def _stage_taken(
    conn: psycopg.Connection[Any], names: sql.Names, held: Sequence[dict[str, Any]]
) -> dict[str, str]:
    """Of the ``held`` jobs (a staged row holds each one's job id), stage again under a fresh
    id those whose row is not that very tick (``schedule_tick_rows``); return {tick's id: the
    fresh id} for those."""
    if not held:
        return {}
    result = conn.execute(sql.query("schedule_tick_rows", names), {"jobs": json.dumps(list(held))})
    same = {str(row[0]) for row in result.fetchall()}
    renamed = {job["job_id"]: str(uuid.uuid4()) for job in held if job["job_id"] not in same}
    moved = [{**job, "job_id": renamed[job["job_id"]]} for job in held if job["job_id"] in renamed]
    staged = _stage(conn, names, moved)
    return {tick_id: fresh for tick_id, fresh in renamed.items() if fresh in staged}


def _qualified(names: sql.Names) -> str:
    return f'"{names.schema}"."{names.schedules}"'


def table_present(db: store.Store) -> bool:
    """Whether the schedules table exists (``drain migrate`` creates it)."""
    row = db.conn.execute(sql.query("table_exists", db.names), {"qualified": _qualified(db.names)}).fetchone()
    return bool(row and row[0])


def _now(conn: psycopg.Connection[Any], names: sql.Names) -> datetime.datetime:
    row = conn.execute(sql.query("schedule_now", names)).fetchone()
    assert row is not None and isinstance(row[0], datetime.datetime)
    return row[0]


def listing(db: store.Store, schedules: Sequence[config.ScheduleSettings]) -> list[dict[str, Any]]:
    """Every schedule, configured or only recorded: name, cron, timezone, last and next tick.

    ``configured`` is False for a row whose schedule left the config (its history); ``next_tick``
    is computed on the database clock for configured schedules only.
    """
    names = db.names
    with db.conn.cursor(row_factory=rows.dict_row) as cursor:
        cursor.execute(sql.query("schedule_list", names))
        recorded = {row["name"]: row for row in cursor.fetchall()}
        now = _now(db.conn, names)
    found: list[dict[str, Any]] = []
    for schedule in schedules:
        row = recorded.pop(schedule.name, None)
        last_tick = row["last_tick"] if row else None
        next_tick = cron.parse(schedule.cron, schedule.timezone).next_after(last_tick or now)
        if last_tick is not None and next_tick is not None and next_tick < now:
            next_tick = now  # overdue: the leader stages it (or skips it, per catch_up) on its next pass
        found.append(
            {
                "name": schedule.name,
                "cron": schedule.cron,
                "timezone": schedule.timezone,
                "catch_up": schedule.catch_up,
                "job_name": schedule.job_name,
                "configured": True,
                "last_tick": last_tick,
                "last_job_id": row["last_job_id"] if row else None,
                "next_tick": next_tick,
            }
        )
    for name, row in sorted(recorded.items()):
        found.append(
            {
                "name": name,
                "cron": row["cron"],
                "timezone": row["timezone"],
                "catch_up": None,
                "job_name": None,
                "configured": False,
                "last_tick": row["last_tick"],
                "last_job_id": row["last_job_id"],
                "next_tick": None,
            }
        )
    return found
