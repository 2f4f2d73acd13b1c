"""Periodic jobs: the leader stages each tick of every ``[[schedules]]`` entry exactly once.

A pass
------
One fenced transaction on the leader's session (a batch's, which first verifies the lock)::

    BEGIN REPEATABLE READ; verify the lock
    now := the database clock (never the drain's: clocks skew)
    lock the schedules' rows in <table>_schedules (FOR UPDATE)
    for each schedule: the ticks in (last_tick, now], cut by catch_up; one job per tick
    INSERT the jobs (run_at = the tick); UPDATE last_tick WHERE it is still what was read
    COMMIT

Exactly once
------------
- The job and the new last tick commit together or not at all: across restarts, failovers and
  a leader killed mid-pass, a tick is staged once.
- A second writer makes the transaction fail (a serialization error, or the compare-and-set
  finding no row) rather than stage twice.
- A tick's job id is ``uuid5(schedule, tick)``: the key a consumer dedupes on, on every backend.
- Anyone can compute it, so a producer may stage a row under it first. A row that is this very
  tick is the tick. Any other row is not: the tick is staged under a fresh random id, with a
  warning (``schedule_tick_id_taken``) naming both ids.

Catch-up
--------
- A leader stages every tick that falls due during its term.
- Ticks that fell due before its term follow the schedule's ``catch_up``: ``all`` stages the
  ``catch_up_max`` most recent, ``latest`` the most recent one, ``none`` skips them.
- A schedule seen for the first time starts at the database's now: its first job is its next tick.
- A schedule removed from the config keeps its row, for ``drain schedules`` to show and to
  resume from if it comes back.
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
from drain.store import admin, sql
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
    """The schedule's options, with its name and tick under the reserved options
    (models.TICK_OPTIONS). Each adapter passes them on where its backend can."""
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

    ``term_start``: the ticks before ``now`` fell due while no drain led, so catch_up applies.
    Otherwise every tick since ``last_tick`` is staged (the ``catch_up_max`` most recent).
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
    """Stages the due ticks of the configured schedules, on the leader's turns (relay's thread).

    ``stage_due`` is cheap on every turn: it opens a transaction only when a tick may be due, at
    least every RECHECK_S, and at once in a new term.
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
        self._logged: set[str] = set()  # the errors logged this term, each once

    def wait_s(self) -> float | None:
        """Seconds until the next pass is due (for the idle wait), or None without schedules or
        when another drain stages them (drain.relay.lanes: lane 0's leader)."""
        if not self.schedules or not self._leadership.leads_schedules:
            return None
        return max(self._next_pass - self._clock(), 0.0)

    def stage_due(self) -> int:
        """As the leader, stage every due tick in one fenced transaction; return how many jobs.

        - A no-op without schedules, or when no tick can be due yet.
        - A no-op while the schedules table is missing or the role may not write it: logged once
          a term, tried again after RECHECK_S. Forwarding goes on.
        - Other database errors and LeadershipLost propagate, like a batch's: nothing committed.
        """
        if not self.schedules or not self._leadership.leads_schedules:
            return 0
        if self._leadership.pid != self._term:
            self._term = self._leadership.pid
            self._term_start = True
            self._next_pass = float("-inf")
            self._logged = set()
        started = self._clock()
        if started < self._next_pass:
            return 0
        if self._term_start and not self._table_present():
            self._next_pass = started + RECHECK_S
            return 0
        try:
            staged, wait_s = self._pass()
        except psycopg.errors.InsufficientPrivilege as exc:
            reason = errors.first_line(exc)
            self._log_once(
                "schedules_refused",
                "schedules are not staged: the drain's role may not write them (%s); grant INSERT "
                "on the table and SELECT, INSERT, UPDATE on its schedules table",
                reason=reason,
            )
            self._next_pass = started + RECHECK_S
            return 0
        self._term_start = False
        self._next_pass = started + min(max(wait_s, MIN_PASS_INTERVAL_S), RECHECK_S)
        return staged

    def _table_present(self) -> bool:
        if self._store.schedules_table_exists():
            return True
        table = self._store.names.qualify(self._store.names.schedules)
        message = "table %s does not exist: schedules are not staged; run `drain migrate`"
        self._log_once("schedules_table_missing", message, table=table)
        return False

    def _log_once(self, event: str, message: str, **fields: str) -> None:
        """Log an error once a term; ``fields`` fill ``message`` and go with the record."""
        if event not in self._logged:
            self._logged.add(event)
            log.error(message, *fields.values(), extra={"event": event, **fields})

    def _pass(self) -> tuple[int, float]:
        """One transaction; returns (jobs staged, seconds from the database's now to the next tick)."""
        names = self._store.names
        with self._store.batch() as batch:
            self._leadership.verify(batch)
            statements = batch.schedules
            now = statements.now()
            last = statements.last_ticks([schedule.name for schedule in self.schedules])
            plans = [
                (each, last.get(each.name), self._plan(each, last.get(each.name), now))
                for each in self.schedules
            ]
            jobs = [
                tick_job(schedule, tick, tick_job_id(names, schedule.name, tick))
                for schedule, _, planned in plans
                for tick in planned.ticks
            ]
            inserted = statements.stage(jobs)
            renamed = _stage_taken(statements, [job for job in jobs if job["job_id"] not in inserted])
            inserted |= set(renamed.values())
            for schedule, previous, planned in plans:
                if planned.last_tick is not None:
                    last_job = (
                        str(tick_job_id(names, schedule.name, planned.ticks[-1])) if planned.ticks else None
                    )
                    advance = {
                        "name": schedule.name,
                        "cron": schedule.cron,
                        "timezone": schedule.timezone,
                        "last_tick": planned.last_tick,
                        "last_job_id": renamed.get(last_job, last_job) if last_job else None,
                        "previous": previous,
                    }
                    if not statements.advance(advance):
                        raise errors.LeadershipLost(
                            f"schedule {schedule.name} was advanced by another session; not staging"
                        )
        for job in jobs:
            _log_staged(job, inserted, renamed)
        upcoming = [
            cron.parse(schedule.cron, schedule.timezone).next_after(planned.last_tick or previous or now)
            for schedule, previous, planned in plans
        ]
        seconds = [(tick - now).total_seconds() for tick in upcoming if tick is not None]
        return len(inserted), min(seconds, default=RECHECK_S)

    def _plan(
        self, schedule: config.ScheduleSettings, previous: datetime.datetime | None, now: datetime.datetime
    ) -> Plan:
        """The schedule's plan in this pass, with a warning when it skips ticks."""
        planned = plan(schedule, previous, now, term_start=self._term_start)
        if planned.skipped:
            log.warning(
                "schedule %s: ticks before %s were not staged (catch_up=%s, catch_up_max=%d)",
                schedule.name,
                (planned.ticks[0] if planned.ticks else now).isoformat(),
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
        return planned


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


def _stage_taken(statements: store.Ticks, held: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Stage again under a fresh id the ``held`` jobs (a staged row holds their job id) whose
    row is not that very tick; return {tick's id: the fresh id}."""
    if not held:
        return {}
    same = statements.same_ticks(held)
    renamed = {job["job_id"]: str(uuid.uuid4()) for job in held if job["job_id"] not in same}
    moved = [{**job, "job_id": renamed[job["job_id"]]} for job in held if job["job_id"] in renamed]
    staged = statements.stage(moved)
    return {tick_id: fresh for tick_id, fresh in renamed.items() if fresh in staged}


def _log_staged(job: Mapping[str, Any], inserted: set[str], renamed: Mapping[str, str]) -> None:
    """Log what became of one tick's job: staged, staged under a fresh id, or already staged."""
    job_id, run_at = job["job_id"], job["run_at"]
    fields = {key: job[key] for key in ("backend", "queue", "job_name", "run_at")}
    if job_id in renamed:
        fresh = renamed[job_id]
        log.warning(
            "schedule tick %s: job id %s is held by a staged row that is not this tick; staged as job %s",
            run_at,
            job_id,
            fresh,
            extra={
                "event": "schedule_tick_id_taken",
                "reason": "job_id_taken",
                **fields,
                "job_ids": [job_id, fresh],
            },
        )
    elif job_id in inserted:
        log.debug(
            "schedule tick %s staged as job %s",
            run_at,
            job_id,
            extra={"event": "schedule_tick_staged", **fields, "job_ids": [job_id]},
        )
    else:  # its job id is still staged: the same tick, so it is not staged again
        log.warning(
            "schedule tick %s: job %s is already staged",
            run_at,
            job_id,
            extra={
                "event": "schedule_tick_already_staged",
                "reason": "already_staged",
                **fields,
                "job_ids": [job_id],
            },
        )


def listing(db: store.Store, schedules: Sequence[config.ScheduleSettings]) -> list[dict[str, Any]]:
    """Every schedule, configured or only recorded: name, cron, timezone, last and next tick.

    ``configured`` is False for a row whose schedule left the config. ``next_tick``, on the
    database clock, is for configured schedules only.
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
