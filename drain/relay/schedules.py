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
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg

from drain import errors, models
from drain.config import cron
from drain.config import settings as config
from drain.relay import leadership
from drain.store import admin, sql, ticks
from drain.store import session as store

log = logging.getLogger(__name__)

# Pinned (tests/unit/test_schedules.py): a tick's job id must not change across versions.
TICK_NAMESPACE = uuid.UUID("5b0c2b6e-5d7a-4a53-9a43-0d1f1c6f2e61")
MIN_PASS_INTERVAL_S = 0.01  # never two passes closer than this, however near the next tick
RECHECK_S = 60.0  # the longest time between passes, even with no tick near


def tick_job_id(names: sql.Names, schedule: str, tick: datetime.datetime) -> uuid.UUID:
    """The job id of one tick: the same for the same table, schedule and instant, whoever stages it."""
    instant = tick.astimezone(datetime.UTC).isoformat()
    return uuid.uuid5(TICK_NAMESPACE, f"{names.qualified}\x00{schedule}\x00{instant}")


def tick_options(schedule: config.ScheduleSettings, tick: datetime.datetime) -> dict[str, Any]:
    """The schedule's options with its name and tick added under the reserved options
    (models.TICK_OPTIONS), which each adapter passes on where its backend can (RQ's ``meta``,
    AMQP headers)."""
    return {
        **schedule.options,
        models.SCHEDULE_OPTION: schedule.name,
        models.TICK_OPTION: tick.astimezone(datetime.UTC).isoformat(),
    }


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
                self._store.names.qualify(self._store.names.schedules),
                extra={
                    "event": "schedules_table_missing",
                    "table": self._store.names.qualify(self._store.names.schedules),
                },
            )
            self._missing_table = True
        return False

    def _pass(self) -> tuple[int, float]:
        """One transaction; returns (jobs staged, seconds from the database's now to the next tick)."""
        with self._store.batch() as batch:
            self._leadership.verify(batch)
            statements = batch.schedules
            now = statements.now()
            last = statements.last_ticks([schedule.name for schedule in self.schedules])
            steps = [self._step(schedule, last.get(schedule.name), now) for schedule in self.schedules]
            jobs = [job for step in steps for job in step.jobs]
            inserted = statements.stage(jobs)
            renamed = _stage_taken(statements, [job for job in jobs if job["job_id"] not in inserted])
            inserted |= set(renamed.values())
            for step in steps:
                if step.advance is not None:
                    _advance(statements, step.advance, renamed)
        for job in jobs:
            _log_staged(job, inserted, renamed)
        upcoming = [step.following for step in steps if step.following is not None]
        wait_s = min((tick - now).total_seconds() for tick in upcoming) if upcoming else RECHECK_S
        return len(inserted), wait_s

    def _step(
        self,
        schedule: config.ScheduleSettings,
        previous: datetime.datetime | None,
        now: datetime.datetime,
    ) -> _Step:
        """What this pass does for one schedule: its plan (warned of the ticks it skips), the
        jobs of its ticks, the advance of its last tick, and the tick that follows."""
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
        jobs = [
            tick_job(schedule, tick, tick_job_id(self._store.names, schedule.name, tick))
            for tick in step.ticks
        ]
        advance = None
        if step.last_tick is not None:
            advance = {
                "name": schedule.name,
                "cron": schedule.cron,
                "timezone": schedule.timezone,
                "last_tick": step.last_tick,
                "last_job_id": jobs[-1]["job_id"] if jobs else None,
                "previous": previous,
            }
        following = cron.parse(schedule.cron, schedule.timezone).next_after(step.last_tick or previous or now)
        return _Step(jobs, advance, following)


@dataclasses.dataclass(frozen=True)
class _Step:
    """What one pass does for one schedule (Scheduler._step)."""

    jobs: list[dict[str, Any]]
    advance: dict[str, Any] | None  # the schedule_advance parameters; None: leave its row as it is
    following: datetime.datetime | None  # its next tick after this pass


def tick_job(schedule: config.ScheduleSettings, tick: datetime.datetime, job_id: uuid.UUID) -> dict[str, Any]:
    """The row of one tick's job, as ``schedule_stage`` takes it (JSON values)."""
    return {
        "job_name": schedule.job_name,
        "job_args": list(schedule.args),
        "job_kwargs": dict(schedule.kwargs),
        "queue": schedule.queue,
        "backend": schedule.backend,
        "job_id": str(job_id),
        "run_at": tick.isoformat(),
        "options": tick_options(schedule, tick),
    }


def _stage_taken(statements: ticks.Ticks, held: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Of the ``held`` jobs (a staged row holds each one's job id), stage again under a fresh
    id those whose row is not that very tick (``schedule_tick_rows``); return {tick's id: the
    fresh id} for those."""
    if not held:
        return {}
    same = statements.same_ticks(held)
    renamed = {job["job_id"]: str(uuid.uuid4()) for job in held if job["job_id"] not in same}
    moved = [{**job, "job_id": renamed[job["job_id"]]} for job in held if job["job_id"] in renamed]
    staged = statements.stage(moved)
    return {tick_id: fresh for tick_id, fresh in renamed.items() if fresh in staged}


def _advance(statements: ticks.Ticks, advance: dict[str, Any], renamed: Mapping[str, str]) -> None:
    """Record a schedule's new last tick (its last job's id, as staged); LeadershipLost when
    another session advanced it meanwhile."""
    advance["last_job_id"] = renamed.get(advance["last_job_id"], advance["last_job_id"])
    if not statements.advance(advance):
        raise errors.LeadershipLost(
            f"schedule {advance['name']} was advanced by another session; not staging"
        )


def _log_staged(job: Mapping[str, Any], inserted: set[str], renamed: Mapping[str, str]) -> None:
    """Log what became of one tick's job: staged, staged under a fresh id, or already staged."""
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
            "schedule tick %s: job id %s is held by a staged row that is not this tick; staged as job %s",
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


def table_present(db: store.Store) -> bool:
    """Whether the schedules table exists (``drain migrate`` creates it)."""
    return db.schedules_table_exists()


def listing(db: store.Store, schedules: Sequence[config.ScheduleSettings]) -> list[dict[str, Any]]:
    """Every schedule, configured or only recorded: name, cron, timezone, last and next tick.

    ``configured`` is False for a row whose schedule left the config (its history); ``next_tick``
    is computed on the database clock for configured schedules only.
    """
    rows, now = admin.Admin(db.conn, db.names).schedules()
    recorded = {row["name"]: row for row in rows}
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
