"""What each page shows, read on a session of its own (drain.store.admin's queries).

- The overview: drain status's figures, the leader and the standbys (drain.store.identity), each
  configured backend with its queues' backlog, the schedules and their next ticks.
- Dead letters: a page of them under a filter, how many match, one in full, and the actions.

Sessions are reused (Sessions). Every statement is bounded: the session's statement_timeout
(PAGE_TIMEOUT_MS for a page, settings.statement_timeout_s for an action); the figures count up
to COUNT_CAP rows each (beyond it the page shows the planner's estimate of the table), the
blocked rows among the first KEY_CAP due rows, the per-queue figures over the QUEUE_CAP oldest
rows: the overview costs the same on any table. A dead-letter page counts its matches up to
PAGE_COUNT_CAP, newest first (a filter many match stops early), and a text filter reads the
newest TEXT_SCAN_ROWS dead letters a page (the next page goes on from there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from drain import config
from drain.relay import lanes, leadership, schedules
from drain.store import admin, connection, identity, migrations
from drain.store import session as store
from drain.version import __version__

PAGE_TIMEOUT_MS = 5_000
COUNT_CAP = 10_000  # beyond it a page shows the planner's estimate
KEY_CAP = 1_000
QUEUE_CAP = 10_000
PAGE_ROWS = 100
PAGE_COUNT_CAP = 1_000  # a dead-letter page counts the matches up to this (ten pages' worth)
TEXT_SCAN_ROWS = 20_000  # a text filter reads this many dead letters a page, newest first
ARGS_BYTES = 4_096  # a page shows arguments stored in at most this many bytes (masked); else their size
IDLE_SESSIONS = 4
OPEN_SESSIONS = 6  # the console's database sessions at most, idle or in use (Busy beyond them)
BUSY_WAIT_S = PAGE_TIMEOUT_MS / 1000  # how long a request waits for one of them
APPLICATION = "drain-console"  # not drain/: `drain status` counts those as standbys


class Sessions:
    """The console's database sessions, reused from one request to the next: a page costs its
    statements, not a connection.

    - At most IDLE_SESSIONS wait idle, each for less than half the session's
      idle_session_timeout (the drain's, drain.store.connection): an older one is closed, not
      handed out to be cut by the server.
    - One that failed or is left in a transaction is closed, never handed out again.
    - At most OPEN_SESSIONS are open at once (the server's max_connections is the drain's too):
      a request that finds none free within BUSY_WAIT_S is Busy.
    """

    def __init__(self, settings: config.Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._clock = clock
        self._idle: list[tuple[float, store.Store]] = []
        self._lock = threading.Lock()
        self._idle_s = connection.idle_session_timeout_ms(settings) / 2000
        self._open = threading.BoundedSemaphore(OPEN_SESSIONS)

    @contextlib.contextmanager
    def session(self, *, acting: bool = False) -> Iterator[store.Store]:
        """A session for one request, its statements bounded to PAGE_TIMEOUT_MS (``acting``: to
        the drain's statement_timeout_s, as ``drain dead`` has)."""
        db = self._take()
        try:
            admin.Admin(db.conn, db.names).limit_statements(self.timeout_ms(acting=acting))
            yield db
        except BaseException:
            self._close(db)
            raise
        idle = db.alive and db.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with self._lock:
            if idle and len(self._idle) < IDLE_SESSIONS:
                self._idle.append((self._clock(), db))
                return
        self._close(db)

    def _close(self, db: store.Store) -> None:
        try:
            db.close()
        finally:
            self._open.release()

    def timeout_ms(self, *, acting: bool = False) -> int:
        """The bound of a session's statements: PAGE_TIMEOUT_MS, or the drain's for an action."""
        return int(self._settings.statement_timeout_s * 1000) if acting else PAGE_TIMEOUT_MS

    def _take(self) -> store.Store:
        now = self._clock()
        with self._lock:
            fresh = [(since, db) for since, db in self._idle if now - since < self._idle_s]
            stale = [db for since, db in self._idle if now - since >= self._idle_s]
            self._idle = fresh
            taken = self._idle.pop()[1] if self._idle else None
        for db in stale:
            self._close(db)
        if taken is not None:
            return taken
        if not self._open.acquire(timeout=BUSY_WAIT_S):
            raise Busy(f"all {OPEN_SESSIONS} of the console's database sessions are in use")
        try:
            opened = store.Store(self._settings)
            opened.name_session(
                f"{APPLICATION}/{__version__} {os.getpid()}@{socket.gethostname()}"[: identity.MAX_BYTES]
            )
        except BaseException:
            self._open.release()
            raise
        return opened


class Busy(Exception):
    """Every one of the console's database sessions stayed in use (Sessions)."""


@dataclasses.dataclass(frozen=True)
class Abilities:
    """Whether this database lets the console act, and if not, why (shown on every page)."""

    primary: bool
    writable: bool
    privileged: bool

    @property
    def may_act(self) -> bool:
        return self.primary and self.writable and self.privileged

    @property
    def why_not(self) -> str | None:
        if not self.primary:
            return "the database is a standby"
        if not self.writable:
            return "the session is read-only (default_transaction_read_only)"
        if not self.privileged:
            return "the role may not insert into the table or delete dead letters"
        return None


def abilities(db: store.Store) -> Abilities:
    return Abilities(**admin.Admin(db.conn, db.names).may_act())


def overview(db: store.Store) -> dict[str, Any]:
    """The overview's figures: backlog, lag, dead letters, leader, standbys, backends, schedules
    (counts capped: see the module)."""
    settings = db.settings
    db.require_table()
    db.require_version(migrations.KEYS_VERSION, "the console (dead letters with their key)")
    queries = admin.Admin(db.conn, db.names)
    figures = db.status(COUNT_CAP, key_cap=KEY_CAP)
    holder = queries.leader(leadership.lock_key(settings.schema, settings.table))
    leader = _leader(holder)
    members = [_member(member) for member in lanes.members(db) if member.lanes is not None or member.led]
    leading = {leader["process"] if leader else None} | {member["process"] for member in members}
    standbys = sorted(
        {
            found.process: found
            for found in map(identity.parse, queries.drains())
            if found is not None and found.process not in leading
        }.values(),
        key=lambda found: found.process,
    )
    found_schedules = schedules.listing(db, settings.schedules) if db.schedules_table_exists() else []
    return {
        "table": db.names.qualified,
        "figures": figures,
        "count_cap": COUNT_CAP,
        "key_cap": KEY_CAP,
        "estimates": queries.estimates(),
        "leader": leader,
        "members": members,
        "standbys": standbys,
        "backends": _backends(settings, queries.queue_backlog(QUEUE_CAP)),
        "queue_cap": QUEUE_CAP,
        "schedules": found_schedules,
    }


def _leader(holder: dict[str, Any] | None) -> dict[str, Any] | None:
    if holder is None:
        return None
    found = identity.parse(holder["application_name"])
    since = found.since if found is not None and found.since is not None else holder["backend_start"]
    return {
        "process": found.process if found is not None else None,
        "host": found.host if found is not None else None,
        "pid": found.pid if found is not None else None,
        "version": found.version if found is not None else None,
        "since": since,
        "backend_pid": holder["pid"],
        "application_name": holder["application_name"],
    }


def _member(member: lanes.Member) -> dict[str, Any]:
    """A member of the table's lanes as the overview shows a leader, with the lanes it leads."""
    holder = {"pid": member.backend_pid, "application_name": member.application_name}
    shown = _leader({**holder, "backend_start": member.backend_start})
    assert shown is not None
    return {**shown, "led": ",".join(map(str, member.led)) or "none", "lanes": member.lanes}


def _backends(settings: config.Settings, queues: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each backend (configured, or named by staged rows only) with its queues and a state:
    idle (nothing due), forwarding (rows due), retrying (rows backing off after a failure), or
    not configured (rows no drain of this config can forward)."""
    names = sorted(set(settings.backends) | {row["backend"] for row in queues})
    found = []
    for name in names:
        mine = [row for row in queues if row["backend"] == name]
        section = settings.backends.get(name)
        if section is None:
            state = "not configured"
        elif any(row["retrying"] for row in mine):
            state = "retrying"
        elif any(row["due"] for row in mine):
            state = "forwarding"
        else:
            state = "idle"
        found.append(
            {
                "name": name,
                "type": section.type if section is not None else None,
                "state": state,
                "queues": mine,
                "due": sum(row["due"] for row in mine),
                "scheduled": sum(row["scheduled"] for row in mine),
            }
        )
    return found


def dead_page(
    db: store.Store, filters: admin.DeadFilter, cut: int
) -> tuple[list[dict[str, Any]], admin.Matching]:
    """A page of dead letters (newest first, PAGE_ROWS at most) and its walk (admin.Matching):
    how many match, counted up to PAGE_COUNT_CAP, and with a text filter (error, arguments),
    which read every row they are asked about, among the newest TEXT_SCAN_ROWS only; the walk
    says where the next one starts (its ``unreached``).

    One walk finds the count and the page's dead letters; the page then reads them by their
    number. A row retried or purged in between is left out of the page.
    """
    db.require_table()
    queries = admin.Admin(db.conn, db.names)
    scan = TEXT_SCAN_ROWS if filters.error is not None or filters.arg is not None else None
    walk = queries.dead_matching(dataclasses.replace(filters, limit=PAGE_ROWS), PAGE_COUNT_CAP, scan)
    if not walk.newest:
        return [], walk
    page = admin.DeadFilter(ids=walk.newest, limit=PAGE_ROWS)
    return queries.dead_page(page, cut, ARGS_BYTES), walk


def dead_letter(db: store.Store, dead_id: int) -> dict[str, Any] | None:
    """One dead letter, whole, or None."""
    found = admin.Admin(db.conn, db.names).dead_list(admin.DeadFilter(ids=[dead_id]))
    return found[0] if found else None


def act(db: store.Store, action: str, filters: admin.DeadFilter, confirmed: int | None) -> admin.Acted:
    """Retry or purge the dead letters matching ``filters`` as ``drain dead`` does; none unless
    the set the confirmation counted (``confirmed``, admin.Counted) matches, in the act's own
    statement."""
    queries = admin.Admin(db.conn, db.names)
    if action == "retry":
        return queries.dead_retry(filters, confirmed)
    return queries.dead_purge(filters, confirmed)


def when(value: Any) -> str:
    """A timestamp as the pages show it: ISO 8601 to the second, UTC, or its text."""
    if isinstance(value, datetime.datetime):
        return value.astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return "" if value is None else str(value)
