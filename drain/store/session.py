"""Every database call the drain makes, on one session that it owns.

The lock, the batch reads and the deletes share this session: if it dies, Postgres releases the
leader lock *and* the pending deletes can no longer commit. The session runs in autocommit mode
(so holding the lock never leaves it idle in a transaction); each batch step is one explicit
REPEATABLE READ transaction that first checks the lock, so its SELECT and its DELETE see one
snapshot taken while leading (a pipelined batch is deleted, by explicit id, in a later step's
transaction). This module is the one place that sets an isolation level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import psycopg
from psycopg import conninfo, rows
from psycopg import sql as pgsql
from psycopg.types import datetime as pg_datetime
from psycopg.types import json as pg_json

from drain import errors, models
from drain.config import settings as config
from drain.observability import redaction
from drain.relay import settlement, settling
from drain.store import identity, migrations, reading, sql

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5
KEEPALIVES_IDLE_S = 5
KEEPALIVES_INTERVAL_S = 2
KEEPALIVES_COUNT = 3
TCP_USER_TIMEOUT_MS = 10_000
MULTI_HOST_SESSION_ATTRS = "read-write"  # for several hosts, when nothing says otherwise
STANDBY_JITTER_MAX = 1.5  # a standby's wait is standby_retry_s jittered up to this (drain.relay.loop)
IDLE_SESSION_MARGIN_S = 10.0
"""Beyond its longest wait, how long the drain's session may be silent before the server ends it:
a turn's own work, and a second session connecting while the lock is taken (connect_timeout)."""
_NO_NAMES = sql.Names("public", "unused")  # for the statements that name no table
_VERSION_TIMEOUTS = ("idle_session_timeout", "transaction_timeout")  # absent before PG 14 / 17
SETTLE_TABLE_PRIVILEGES = ("SELECT", "UPDATE", "DELETE")
SETTLE_DEAD_PRIVILEGES = ("SELECT", "INSERT")
SETTLE_VERSIONS_PRIVILEGES = ("SELECT",)
PARKED_AT = datetime.datetime(9000, 1, 1, tzinfo=datetime.UTC)
"""The run_at of a parked row (Batch.park): never due; below the table's check's bound (9999)."""
PARKED_PREFIX = "drain: parked:"
"""How a parked row's last_error starts: with PARKED_AT, what tells it from a job an app staged
for that date (``parked_count``)."""
PARKED_IN_PLACE_PREFIX = "drain: parked in place:"
"""How the last_error of a row parked in place starts (Batch.park_in_place: the table refused
its parking too, so its run_at stays): no statement that looks for due rows takes such a row
(``not_parked_in_place`` in queries.sql, which spells it out)."""
DELETE, RETRY, BURY, SELECT = "delete", "retry", "bury", "select"
PROBE_KINDS = (DELETE, RETRY, BURY)
"""The kinds of settlement write a probe tries (Batch.test_table, Batch.probe); SELECT is the
read of a row of the drain's own."""
PROBE_ERROR = "drain: probe (rolled back)"
PROBE_JOB_NAME = "drain.probe"
"""The job_name of the row of its own a probe writes and rolls back (Batch.test_table)."""
PROBE_LOCK_WAIT_MS = 1000
"""The longest a probe's statement waits for a lock: longer, the table is locked against writes."""
OWN_ROW, ANY_ROW = "a row of its own", "any row"
"""What a probe wrote (ProbeFailure.target), besides the due rows."""

Key = tuple[int, uuid.UUID]
"""A row as a settlement names it: id and job_id."""


class Refusal(NamedTuple):
    """Why the table refused one row's settlement; ``transient`` (a lock wait, a serialization
    failure, a cancelled statement: :func:`transient`) when writing it again may go through."""

    why: str
    transient: bool = False


Refused = dict[int, Refusal]
"""Rows whose settlement the table refused, by id, with why."""
Done = tuple[int, set[int] | None]
"""What a settlement statement changed: how many rows, and which (None: not known)."""
T = TypeVar("T")


class ProbeFailure(NamedTuple):
    """The kind of write (DELETE, RETRY, BURY, or the SELECT of a row of its own) a probe's
    ``target`` did not take, and why."""

    kind: str
    detail: str
    target: str = "due rows"


class TableTest(NamedTuple):
    """What Batch.test_table found: ``tested`` False when it could not write a row of its own
    (nothing known); else ``failure``, the kind of write the table refused and why, or None."""

    tested: bool
    failure: ProbeFailure | None = None


def idle_in_transaction_timeout_ms(publish_timeout_s: float) -> int:
    """The server-side fence for a hung publish: well above the publish deadline.

    If a publish outlives it, Postgres ends the session, which releases the lock and makes the
    batch's delete impossible: the rows are published again by the next leader (a duplicate,
    never a loss).
    """
    return int(config.batch_fence_s(publish_timeout_s) * 1000)


def longest_silence_s(settings: config.Settings) -> float:
    """The longest the drain's session legitimately goes without a statement outside a
    transaction: the idle leader's poll (``poll_max_s``; ``wakeup_poll_max_s`` while the wake-up
    is armed), a standby's wait for the lock, a leader's wait to write a failed settlement again."""
    waits = [settings.poll_max_s, settings.standby_retry_s * STANDBY_JITTER_MAX, settling.RETRY_MAX_S]
    if settings.wakeup == config.WAKEUP_NOTIFY:
        waits.append(settings.wakeup_poll_max_s)
    return max(waits)


def idle_session_timeout_ms(settings: config.Settings) -> int:
    """The server-side fence for a frozen leader between batches: its longest silence plus
    IDLE_SESSION_MARGIN_S (20 s by default).

    A leader stopped (SIGSTOP, a hung VM, a wedged process) while its session idles holds the
    lock until the session ends; with this as its ``idle_session_timeout`` (PostgreSQL 14+), the
    server ends it and a standby leads. A healthy drain always speaks sooner.
    """
    return int((longest_silence_s(settings) + IDLE_SESSION_MARGIN_S) * 1000)


def listed_hosts(params: Mapping[str, Any], env: Mapping[str, str]) -> int:
    """How many hosts libpq tries for these DSN parameters, with ``PGHOST`` / ``PGHOSTADDR``
    where the DSN names none (as psycopg splits them into attempts); 0 when neither does."""
    counts = [0]
    for key, variable in (("host", "PGHOST"), ("hostaddr", "PGHOSTADDR")):
        value = params[key] if key in params else env.get(variable)
        if value:
            counts.append(len(str(value).split(",")))
    return max(counts)


def _session_attrs_set(params: Mapping[str, Any], env: Mapping[str, str]) -> bool:
    return "target_session_attrs" in params or bool(env.get("PGTARGETSESSIONATTRS"))


def connection_kwargs(settings: config.Settings, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """libpq parameters for the drain's session; a parameter set in the DSN wins.

    The timeouts are not among them: :func:`connect` SETs them after connecting and reads them
    back, because a pooler may drop a startup ``options`` parameter without a word.

    Several hosts — in the DSN, or in ``PGHOST`` / ``PGHOSTADDR`` (``env``, default: the
    process's) when the DSN names none — get ``target_session_attrs=read-write`` unless the DSN
    or ``PGTARGETSESSIONATTRS`` sets it: libpq then skips a standby (or a read-only server) and
    connects to the host that can settle, wherever it is in the list; a drain on a standby would
    only stand by there (drain.relay.settling). One host is connected to as it is, so a drain given a
    standby stands by there and says why. (Hosts from a service file: :func:`connect`.)
    """
    env = os.environ if env is None else env
    present = conninfo.conninfo_to_dict(settings.dsn) if settings.dsn else {}
    wanted: dict[str, Any] = {
        "application_name": identity.application_name(),
        "connect_timeout": CONNECT_TIMEOUT_S,
        "keepalives": 1,
        "keepalives_idle": KEEPALIVES_IDLE_S,
        "keepalives_interval": KEEPALIVES_INTERVAL_S,
        "keepalives_count": KEEPALIVES_COUNT,
        "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
    }
    if listed_hosts(present, env) > 1 and not _session_attrs_set(present, env):
        wanted["target_session_attrs"] = MULTI_HOST_SESSION_ATTRS
    if env.get("PGAPPNAME"):
        del wanted["application_name"]  # the operator's name for these sessions
    return {key: value for key, value in wanted.items() if key not in present}


def session_timeouts_ms(settings: config.Settings) -> dict[str, int]:
    """The timeouts the drain's session must run with, in milliseconds (0: off).

    ``idle_session_timeout`` (PostgreSQL 14+) is :func:`idle_session_timeout_ms`, whatever a role
    or database sets: shorter, it would end the idle leader's session between batches and with
    it the lock; off, a frozen leader would keep the lock forever. ``transaction_timeout`` (17+)
    is off: a role's would end a long term. A server without one of them is checked for the
    others only.
    """
    return {
        "statement_timeout": int(settings.statement_timeout_s * 1000),
        "idle_timeout": idle_in_transaction_timeout_ms(settings.publish_timeout_s),
        "idle_session_timeout": idle_session_timeout_ms(settings),
        "transaction_timeout": 0,
    }


def _server_keepalives() -> dict[str, str]:
    """The server's side of the socket, as the drain's libpq side (set_timeouts)."""
    return {
        "keepalives_idle": str(KEEPALIVES_IDLE_S),
        "keepalives_interval": str(KEEPALIVES_INTERVAL_S),
        "keepalives_count": str(KEEPALIVES_COUNT),
        "tcp_user_timeout": str(TCP_USER_TIMEOUT_MS),
    }


def connect(settings: config.Settings, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    """Open a session with the drain's keepalives and timeouts, the timeouts verified.

    Raises DrainError with a one-line reason (password redacted) when it cannot connect or the
    session does not keep the timeouts it was given.
    """
    where = redaction.redact(settings.dsn) or "(libpq defaults)"  # also a DSN urllib cannot parse
    kwargs = connection_kwargs(settings)
    try:
        conn = psycopg.connect(settings.dsn, autocommit=True, **kwargs)
        if "target_session_attrs" not in kwargs and _standby_of_several(conn, settings.dsn):
            conn.close()  # hosts from a service file: libpq picks the writable one on request
            kwargs["target_session_attrs"] = MULTI_HOST_SESSION_ATTRS
            conn = psycopg.connect(settings.dsn, autocommit=True, **kwargs)
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:  # a malformed DSN: libpq quotes it
        reason = redaction.redact(errors.first_line(exc))
        raise errors.DrainError(f"cannot connect to the database {where}: {reason}") from None
    try:
        wanted = session_timeouts_ms(settings)
        values = {key: str(value) for key, value in wanted.items()}
        conn.execute(sql.query("set_timeouts", _NO_NAMES), {**values, **_server_keepalives()})
        if conn.info.encoding == "ascii":  # client_encoding SQL_ASCII: psycopg would load text as bytes
            _load_text_as_utf8(conn)
        row = conn.execute(sql.query("session_timeouts", _NO_NAMES)).fetchone()
        got = dict(zip(("statement_timeout", "idle_timeout", *_VERSION_TIMEOUTS), row or (), strict=False))
        for name in _VERSION_TIMEOUTS:
            if got.get(name, 0) is None:  # this server has no such setting: nothing to keep
                del got[name], wanted[name]
        if got != wanted:
            raise errors.DrainError(
                f"the database session at {where} did not keep its timeouts (wanted {wanted} ms, "
                f"got {got} ms): is a pooler resetting session settings?"
            )
        conn.autocommit = autocommit
    except BaseException:
        conn.close()
        raise
    return conn


def _standby_of_several(conn: psycopg.Connection[Any], dsn: str) -> bool:
    """Whether libpq connected to a standby or a read-only server out of several hosts that no
    DSN, ``PG*`` variable or connection_kwargs counted: a service file's (``service=`` or
    ``PGSERVICE``), which only libpq reads. Then, as for any list of hosts, nothing set
    ``target_session_attrs`` (the service file may: then it is not ``any``)."""
    params = conninfo.conninfo_to_dict(dsn) if dsn else {}
    if _session_attrs_set(params, os.environ):
        return False
    used = {option.keyword.decode(): option.val.decode() for option in conn.pgconn.info if option.val}
    if used.get("target_session_attrs", "any") != "any" or listed_hosts(used, {}) < 2:
        return False
    standby = conn.info.parameter_status("in_hot_standby")  # reported by PostgreSQL 14+
    read_only = conn.info.parameter_status("default_transaction_read_only")
    return standby != "off" or read_only != "off"  # unknown (older servers): let libpq check


class _Utf8TextLoader(psycopg.adapt.Loader):
    """Text as str on a SQL_ASCII session, where psycopg hands it over as bytes: UTF-8 (names,
    channels, error texts the drain wrote), and as bytes only when it is not UTF-8 — which
    drain.store.decoding then refuses for a staged row, as it always did."""

    def load(self, data: Any) -> str | bytes:
        raw = bytes(data)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw


class _LenientTextLoader(psycopg.adapt.Loader):
    """Text as str whatever its bytes (shown by the CLI: a dead letter's names may not be UTF-8)."""

    def load(self, data: Any) -> str:
        return bytes(data).decode("utf-8", "replace")


_TEXT_TYPES = ("text", "varchar", "bpchar", "name", '"char"')


def _load_text_as_utf8(conn: psycopg.Connection[Any]) -> None:
    for name in _TEXT_TYPES:
        conn.adapters.register_loader(name, _Utf8TextLoader)
    conn.adapters.register_loader(0, _Utf8TextLoader)  # unknown: a literal's type


@dataclasses.dataclass(frozen=True)
class Due:
    """What ``anything_due`` saw, in a statement after the wake lock was taken."""

    staged_now: bool  # a row staged for now (run_at null)
    fell_due: bool  # a row whose run_at has passed
    next_due_s: float | None  # seconds until the earliest future row falls due; None: no such row

    @property
    def now(self) -> bool:
        return self.staged_now or self.fell_due


class Store:
    """The drain's database session. Not thread-safe; the relay uses it from one thread."""

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self.names = sql.Names(settings.schema, settings.table)
        self.reader = reading.Reader(settings.batch_max_bytes)
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.settings)
            # Statements outside a block stay autocommit; every transaction block (a batch) opens
            # with BEGIN ISOLATION LEVEL REPEATABLE READ, in one round trip.
            self._conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        return self._conn

    @property
    def alive(self) -> bool:
        """Whether the session is open and usable (not closed, not broken by a lost connection)."""
        return self._conn is not None and not self._conn.closed and not self._conn.broken

    def close(self) -> None:
        """Close the session; the server releases any lock it held. Idempotent."""
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None

    def _one(self, name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        with self.conn.cursor(row_factory=rows.dict_row) as cursor:
            cursor.execute(sql.query(name, self.names), params)
            row = cursor.fetchone()
        assert row is not None
        return row

    # --- schema ---------------------------------------------------------------------------

    def migrate(self) -> migrations.Report:
        """Create the table at the current schema version or upgrade it in place; idempotent.

        On a session of its own: READ COMMITTED (the batch session's REPEATABLE READ would fail
        on rows the drain changes meanwhile) and no statement timeout (checking the rows already
        in a big table takes as long as it takes; the locks that matter are bounded apart).
        """
        with connect(self.settings) as conn:
            conn.execute(migrations.statement("no_statement_timeout", self.names))
            return migrations.upgrade(migrations.Session(conn), self.names)

    def schema_version(self) -> int:
        """The table's schema version (drain.store.migrations): 0 without a table, 1 for drain 0.1.0's."""
        return migrations.current_version(migrations.Session(self.conn), self.names)

    def not_valid_constraints(self) -> list[str]:
        """The table's constraints still NOT VALID: rows in it break them."""
        rows = self.conn.execute(migrations.statement("not_valid", self.names)).fetchall()
        return [str(row[0]) for row in rows]

    def require_version(self, minimum: int, what: str) -> None:
        """SchemaError (run `drain migrate`) when the table is older than ``minimum``."""
        version = self.schema_version()
        if version < minimum:
            raise errors.SchemaError(
                f"{what} needs schema version {minimum}; {self.names.qualified} is at {version}: "
                "run `drain migrate`"
            )

    def table_exists(self) -> bool:
        return bool(self._one("table_exists", {"qualified": self.names.qualified})["present"])

    def require_table(self) -> None:
        if not self.table_exists():
            raise errors.SchemaError(f"table {self.names.qualified} does not exist; run `drain migrate`")

    # --- can this session settle? (drain.relay.settling) ---------------------------------------

    def settle_check(self) -> dict[str, Any]:
        """in_recovery, read_only, role, the privileges a settlement needs that the role lacks
        (table_missing, dead_missing, versions_missing: lists of privilege names), the three
        tables' quoted names (table, dead, versions), the table's schema_version (None when the
        role may not read it) and the latest_version this drain writes for. See
        ``settle_check`` in queries.sql."""
        conn = self.conn
        dead = pgsql.Identifier(self.names.schema, self.names.dead).as_string(conn)
        versions = pgsql.Identifier(self.names.schema, self.names.versions).as_string(conn)
        with conn.cursor(row_factory=rows.dict_row) as cursor:
            cursor.execute(
                sql.query("settle_check", self.names),
                {
                    "table": self.names.qualified,
                    "dead": dead,
                    "versions": versions,
                    "table_privileges": list(SETTLE_TABLE_PRIVILEGES),
                    "dead_privileges": list(SETTLE_DEAD_PRIVILEGES),
                    "versions_privileges": list(SETTLE_VERSIONS_PRIVILEGES),
                },
            )
            row = cursor.fetchone()
        assert row is not None
        version = None if row["versions_missing"] else self.schema_version()
        return {
            **row,
            "table": self.names.qualified,
            "dead": dead,
            "versions": versions,
            "schema_version": version,
            "latest_version": migrations.LATEST_VERSION,
        }

    def probe_settlement(self, limit: int) -> ProbeFailure | None:
        """Whether the table takes every kind of settlement, rolled back: a row of the drain's
        own (Batch.test_table); without one (no INSERT privilege, or the table refuses it), the
        first ``limit`` due rows this session can lock, each kind written for all of them, and
        for each alone until one takes it (Batch.probe). The kind refused and why (a trigger that
        refuses or skips, a deferred constraint, the dead-letter table, a lock, a row-level
        security policy hiding the drain's own row), or None. Its lock waits are bounded
        (PROBE_LOCK_WAIT_MS). The due rows are those a first batch takes, within
        ``batch_max_bytes``: the probe costs what one batch costs, however big the backlog's rows
        (select_due renders no row past its cuts). Raises when the session is lost, or the due
        rows cannot be read."""
        with self.conn.transaction(force_rollback=True):
            batch = Batch(self.conn, self.names, reader=self.reader)
            batch.limit_lock_wait(PROBE_LOCK_WAIT_MS)
            test = batch.test_table(PROBE_KINDS)
            if test.tested or test.failure is not None:
                return test.failure
            return batch.probe(batch.select_due(limit))

    def parked(self) -> int:
        """How many rows are parked: run_at PARKED_AT and last_error PARKED_PREFIX (Batch.park),
        or parked in place, among the due rows (Batch.park_in_place)."""
        return int(self._one("parked_count", {"parked_at": PARKED_AT, "prefix": PARKED_PREFIX})["parked"])

    # --- the leader lock ------------------------------------------------------------------

    def try_lock(self, key: int) -> tuple[bool, int]:
        """Try the session-level advisory lock once; return (acquired, backend pid)."""
        row = self._one("try_lock", {"key": key})
        return bool(row["acquired"]), int(row["pid"])

    def name_session(self, name: str) -> None:
        """Set this session's application_name (drain.store.identity), unless the DSN or the
        environment (PGAPPNAME) chose one."""
        if "application_name" in connection_kwargs(self.settings):
            self._one("set_application_name", {"name": name})

    def drains(self) -> list[str]:
        """The application names of the drain sessions connected to this database."""
        with self.conn.cursor() as cursor:
            cursor.execute(sql.query("drains", self.names))
            return [str(row[0]) for row in cursor.fetchall()]

    def lock_held(self, key: int) -> tuple[bool, int]:
        """Whether this very session holds the lock, and its backend pid."""
        classid, objid = split_key(key)
        row = self._one("lock_held", {"classid": classid, "objid": objid, "relaxed": False})
        return bool(row["held"]), int(row["pid"])

    def lock_held_elsewhere(self, key: int) -> tuple[bool, int]:
        """Run the lock_held check on a second, brand-new session: (held there, its backend pid).

        Directly or through a session pool, that session is another backend and does not hold
        our lock. A transaction pool hands out idle server connections last-in first-out, so it
        gives this probe the very backend our last statement ran on: the one holding the lock.
        The probe then unlocks it there, or the pool would keep it orphaned on that backend.
        """
        classid, objid = split_key(key)
        with connect(self.settings) as probe:
            row = probe.execute(
                sql.query("lock_held", self.names), {"classid": classid, "objid": objid, "relaxed": False}
            ).fetchone()
            assert row is not None
            if row[1]:
                probe.execute(sql.query("unlock", self.names), {"key": key})
        return bool(row[1]), int(row[0])

    def unlock(self, key: int) -> None:
        self._one("unlock", {"key": key})

    def leader(self, key: int) -> dict[str, Any] | None:
        """Who holds the leader lock: pid, application_name, client_addr, backend_start."""
        classid, objid = split_key(key)
        with self.conn.cursor(row_factory=rows.dict_row) as cursor:
            cursor.execute(sql.query("leader", self.names), {"classid": classid, "objid": objid})
            return cursor.fetchone()

    # --- batches --------------------------------------------------------------------------

    @contextlib.contextmanager
    def batch(self, *, relaxed: bool = False) -> Iterator[Batch]:
        """One REPEATABLE READ transaction: commits on success, rolls back on any exception.

        ``relaxed``: the transaction commits with ``synchronous_commit = off`` (set by its first
        statement, the lock check), so the relay does not wait for the WAL flush after every
        batch. Only for settlements: one lost to a crash of Postgres (the last few hundred
        milliseconds of commits) leaves its rows staged, and they are forwarded again — a
        duplicate, never a loss. A schedule's pass stages jobs and must not be lost: not relaxed.
        """
        conn = self.conn
        with conn.transaction():
            yield Batch(conn, self.names, relaxed=relaxed, reader=self.reader)

    def seconds_until_due(self) -> float | None:
        """Seconds until the earliest future row falls due (database clock), or None."""
        value = self._one("seconds_until_due")["seconds"]
        return None if value is None else float(value)

    def status(self, cap: int | None = None) -> dict[str, Any]:
        """due, future, backlog, oldest_due_age_s, dead: the CLI's figures and the leader's gauges.

        Each count walks an index and stops at ``cap`` rows (None: exact, for the CLI).
        """
        return self._one("status", {"cap": cap})

    # --- the wake-up (drain.relay.wakeup) -------------------------------------------------------

    def _wake_names(self) -> dict[str, Any]:
        return {"schema": self.settings.schema, "table": self.settings.table}

    def wake_arm(self) -> tuple[bool, str]:
        """Try to take the table's wake lock: (taken, the channel producers then notify)."""
        row = self._one("wake_arm", self._wake_names())
        return bool(row["armed"]), str(row["channel"])

    def wake_disarm(self) -> None:
        self._one("wake_disarm", self._wake_names())

    def anything_due(self) -> Due:
        """Whether a row is due, and when the earliest future one falls due."""
        row = self._one("anything_due")
        seconds = None if row["next_due_s"] is None else float(row["next_due_s"])
        return Due(bool(row["staged_now"]), bool(row["fell_due"]), seconds)

    def wake_trigger_enabled(self) -> bool:
        """Whether producers' INSERTs fire the wake-up trigger."""
        return bool(self._one("wake_trigger_enabled", {"qualified": self.names.qualified})["enabled"])

    def listen(self, channel: str) -> object:
        """LISTEN on ``channel`` on this session; return a token that changes when the session does."""
        conn = self.conn
        conn.execute(pgsql.SQL("LISTEN {}").format(pgsql.Identifier(channel)))
        return conn

    def listening_on(self) -> object | None:
        """The token of the current session (None when closed): compare with listen()'s."""
        return self._conn if self._conn is not None and not self._conn.closed else None

    def wait_notified(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for notifications on this session; return how many came
        (0 on timeout). Those that arrived during earlier statements count at once.

        Only their coming matters: one psycopg cannot decode (a payload that is not ASCII on a
        SQL_ASCII session, which psycopg decodes as ASCII) counts as one."""
        try:
            return sum(1 for _ in self.conn.notifies(timeout=max(timeout_s, 0.0), stop_after=1))
        except UnicodeDecodeError:
            return 1

    # --- dead letters ---------------------------------------------------------------------

    def dead_list(self, filters: DeadFilter) -> list[dict[str, Any]]:
        """Dead letters matching ``filters``, oldest first. A value Python cannot hold (JSON too
        deep or with too long a number, a timestamp out of ``datetime``'s range: often the very
        reason the row died) comes as its text instead."""
        with self.conn.cursor(row_factory=rows.dict_row) as cursor:
            cursor.adapters.register_loader("jsonb", _LenientJsonbLoader)
            cursor.adapters.register_loader("timestamptz", _LenientTimestamptzLoader)
            if self.conn.info.encoding == "ascii":  # a SQL_ASCII database: names may not be UTF-8
                for name in _TEXT_TYPES:
                    cursor.adapters.register_loader(name, _LenientTextLoader)
            cursor.execute(sql.query("dead_list", self.names), filters.params())
            return cursor.fetchall()

    def dead_retry(self, filters: DeadFilter) -> Retried:
        """Move matching dead letters back to the table; return how many moved and how many the
        table refused.

        Each gets a new row id, keeps its job_id, and is due now with attempts reset. A dead
        letter whose job_id is staged again already stays where it is. All in one transaction,
        unless a dead letter breaks one of the table's constraints (one buried by `drain
        migrate`, or before the table had them): then one at a time, newest first (as the single
        statement prefers the newest of a job_id), and those the table refuses stay dead.
        """
        try:
            with self.conn.transaction(), self.conn.cursor() as cursor:
                cursor.execute(sql.query("dead_retry", self.names), filters.params())
                return Retried(len(cursor.fetchall()), 0)
        except _REFUSED_BY_TABLE:
            pass
        with self.conn.cursor() as cursor:
            cursor.execute(sql.query("dead_ids", self.names), filters.params())
            ids = [int(row[0]) for row in cursor.fetchall()]
        moved = refused = 0
        for dead_id in ids:
            try:
                with self.conn.transaction(), self.conn.cursor() as cursor:
                    cursor.execute(sql.query("dead_retry", self.names), DeadFilter(ids=[dead_id]).params())
                    moved += len(cursor.fetchall())
            except _REFUSED_BY_TABLE:
                refused += 1
        return Retried(moved, refused)

    def dead_purge(self, filters: DeadFilter) -> int:
        """Delete matching dead letters; return how many."""
        with self.conn.transaction(), self.conn.cursor() as cursor:
            cursor.execute(sql.query("dead_purge", self.names), filters.params())
            return len(cursor.fetchall())


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


class Batch:
    """The statements of one batch transaction."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        names: sql.Names,
        *,
        relaxed: bool = False,
        reader: reading.Reader | None = None,
    ) -> None:
        self._conn = conn
        self._names = names
        self._relaxed = relaxed
        self._reader = reader or reading.Reader(config.BATCH_MAX_BYTES)
        self._tests: dict[str, TableTest] = {}  # test_table's findings, by kind, in this transaction
        self._lock_wait_ms = PROBE_LOCK_WAIT_MS  # what limit_lock_wait set (test_table waits no longer)
        self.held_back = False
        """Whether the last select_due left due rows for want of budget (select again at once)."""

    def check_lock(self, key: int, pid: int) -> None:
        """Fence: raise unless this session is the backend that took the lock.

        Runs first in the batch, so the snapshot the batch reads under is one in which we lead.
        """
        classid, objid = split_key(key)
        with self._conn.cursor() as cursor:
            cursor.execute(
                sql.query("lock_held", self._names),
                {"classid": classid, "objid": objid, "relaxed": self._relaxed},
            )
            row = cursor.fetchone()
        assert row is not None
        current_pid, held = int(row[0]), bool(row[1])
        if current_pid != pid:
            raise errors.PoolerDetected(
                f"the database session changed from backend {pid} to {current_pid}: "
                "a transaction-pooling proxy (PgBouncer pool_mode=transaction?) is in the way; "
                "connect the drain directly or through a session-mode pool"
            )
        if not held:
            raise errors.LeadershipLost(f"backend {pid} no longer holds the leader lock")

    def select_due(
        self,
        limit: int,
        paused: Sequence[str] = (),
        exclude: Sequence[int] = (),
        budget_bytes: int | None = None,
    ) -> list[models.StagedJob]:
        """Up to ``limit`` due rows in id order, except those of ``paused`` backends and the
        ``exclude`` ids (a batch still in flight), within ``budget_bytes`` of decoded weight
        (default: the whole ``batch_max_bytes``; drain.store.reading). A row that cannot be read is a
        job with ``unreadable`` set; rows that do not fit are left for the next select
        (``held_back``). Raises only for the database, never for what a row holds."""
        self.held_back = False
        if limit <= 0:
            return []
        budget = self._reader.batch_max_bytes if budget_bytes is None else budget_bytes
        with self._conn.cursor() as cursor:
            cursor.execute(
                sql.query("select_due", self._names),
                {"paused": list(paused), "exclude": list(exclude), **self._reader.params(limit, budget)},
            )
            read_at = time.monotonic()
            fetched = cursor.fetchall()
        taken = self._reader.take(fetched, budget, read_at)
        self.held_back = taken.held_back
        return taken.jobs

    def delete(self, jobs: Sequence[models.StagedJob], *, careful: bool = False) -> Refused:
        """Delete exactly these rows, each by its id and job_id (never a range: ids commit out of
        order; an id reused since the row was read is another job); return those the table
        refused, with why. A row left in place without an error (a trigger returning NULL, a
        rule, a row-level security policy) is refused; one an app deleted meanwhile is simply
        gone. Not ``careful``, an error propagates (the relay writes the settlement again,
        carefully): ``careful``, see ``_part``."""
        return self._part(DELETE, self._delete, [(job.id, job.job_id) for job in jobs], careful=careful)

    def record_failures(self, retries: Sequence[settlement.Retry]) -> Refused:
        """Push failed rows back by their delay, adding what each counts to its attempts; return
        those the table refused. Carefully (``_part``): a refused backoff never undoes the rest
        of the settlement."""
        return self._part(RETRY, self._record_failures, retries, careful=True)

    def bury(self, dead: Sequence[settlement.Dead]) -> Refused:
        """Move rows to the dead-letter table with their error; return those refused (by the
        table, or by the dead letters: a row is never deleted without its dead letter).
        Carefully (``_part``)."""
        return self._part(BURY, self._bury, dead, careful=True)

    def park(self, job: models.StagedJob, error: str) -> bool:
        """Park a row whose settlement the table refused: ``run_at`` PARKED_AT (no select takes it
        again) and ``error`` (which starts with PARKED_PREFIX) in last_error, in a savepoint;
        False if the table refuses that too (whatever the error, while the session stays up)."""
        params = {
            "id": job.id,
            "job_id": job.job_id,
            "parked_at": PARKED_AT,
            "error": settlement.storable(error),
        }
        try:
            with self._conn.transaction():
                cursor = self._conn.execute(sql.query("park", self._names), params)
        except psycopg.Error:
            if self._conn.broken:
                raise
            return False
        return cursor.rowcount == 1

    def park_in_place(self, job: models.StagedJob, error: str) -> bool:
        """Park a row whose parking the table refused too: only its last_error, ``error`` (which
        starts with PARKED_IN_PLACE_PREFIX; no select takes such a row again), its run_at left as
        it is, in a savepoint; False if the table refuses that too (the row is then held by the
        process, drain.relay.settling.Unsettled)."""
        params = {"id": job.id, "job_id": job.job_id, "error": settlement.storable(error)}
        try:
            with self._conn.transaction():
                cursor = self._conn.execute(sql.query("park_in_place", self._names), params)
        except psycopg.Error:
            if self._conn.broken:
                raise
            return False
        return cursor.rowcount == 1

    def fire_deferred(self) -> None:
        """Run deferred constraint triggers at each statement from now on, not at COMMIT."""
        self._conn.execute(sql.query("fire_deferred", self._names))

    def present(self, keys: Sequence[Key]) -> list[int]:
        """Which of these rows (id, job_id) are in the table."""
        if not keys:
            return []
        cursor = self._conn.execute(
            sql.query("present_ids", self._names),
            {"ids": [key[0] for key in keys], "job_ids": [key[1] for key in keys]},
        )
        return [int(row[0]) for row in cursor.fetchall()]

    # --- does the table take settlements? (drain.relay.settling) ------------------------------------

    def test_table(self, kinds: Sequence[str] = PROBE_KINDS) -> TableTest:
        """Whether the table itself takes these kinds of settlement write, whichever rows a
        settlement names: first the lock every write takes (refused within PROBE_LOCK_WAIT_MS, or
        the transaction's shorter lock wait: the table is locked against writes); then, if this
        role may INSERT, a row of the drain's own (PROBE_JOB_NAME, a fresh job_id, a random
        negative id, every other value the table's default), which its SELECT must see, and
        each kind of write of it (the DELETE, the retry UPDATE, the burial), each in a
        savepoint, deferred constraints fired. Everything is rolled back; the transaction stays
        usable. Not ``tested`` when no such row could be written (no INSERT privilege; a
        trigger, a constraint or a policy refused it): nothing is known then. Remembered for
        this transaction. Raises only when the session is lost."""
        wanted = [kind for kind in kinds if kind not in self._tests]
        if wanted:
            self._tests.update(self._test_table(wanted))
        tests = [self._tests[kind] for kind in kinds]
        failed = [test for test in tests if test.failure is not None]
        if failed:
            return failed[0]
        return TableTest(all(test.tested for test in tests))

    def _test_table(self, kinds: Sequence[str]) -> dict[str, TableTest]:
        with self._conn.transaction(force_rollback=True):
            wait_ms = min(self._lock_wait_ms, PROBE_LOCK_WAIT_MS)
            self._conn.execute(sql.query("limit_lock_wait", self._names), {"ms": str(wait_ms)})
            locked = self._locked(kinds)
            if locked is not None:
                failure = ProbeFailure(kinds[0], f"the table is locked against writes: {locked}", ANY_ROW)
                return dict.fromkeys(kinds, TableTest(True, failure))
            job_id = self._own_row()
            if job_id is None:
                return dict.fromkeys(kinds, TableTest(False))
            seen = self._conn.execute(sql.query("probe_row_id", self._names), {"job_id": job_id}).fetchone()
            if seen is None:
                failure = ProbeFailure(
                    SELECT,
                    "its SELECT does not see it: a row-level security policy hides rows from this role",
                    OWN_ROW,
                )
                return dict.fromkeys(kinds, TableTest(True, failure))
            now = datetime.datetime.now(datetime.UTC)
            job = models.StagedJob(
                int(seen[0]), job_id, PROBE_JOB_NAME, [], {}, "default", "default", {}, now
            )
            tests = {}
            for kind in kinds:
                why = self._try(*self._writes(kind, [job]))
                tests[kind] = TableTest(True, None if why is None else ProbeFailure(kind, why, OWN_ROW))
            return tests

    def _locked(self, kinds: Sequence[str]) -> str | None:
        """Why the lock a settlement write takes was not granted within the lock wait, or None
        (another error, a missing table say, is left for the writes to meet)."""
        try:
            with self._conn.transaction():
                self._conn.execute(sql.query("lock_for_writes", self._names))
                if BURY in kinds:
                    self._conn.execute(sql.query("lock_dead_for_writes", self._names))
        except psycopg.Error as exc:
            if self._conn.broken:
                raise
            if isinstance(exc, psycopg.errors.LockNotAvailable | psycopg.errors.QueryCanceled):
                return errors.first_line(exc)
        return None

    def _own_row(self) -> uuid.UUID | None:
        """Write a row of the drain's own (the caller rolls it back): its job_id; None if this
        role may not INSERT, or the table refuses the row."""
        allowed = self._conn.execute(sql.query("can_insert", self._names), {"table": self._names.qualified})
        if allowed.fetchone() != (True,):
            return None
        job_id = uuid.uuid4()
        params = {"id": -secrets.randbits(62) - 1, "job_name": PROBE_JOB_NAME, "job_id": job_id}
        try:
            with self._conn.transaction():
                self._conn.execute(sql.query("probe_row", self._names), params)
        except psycopg.Error:
            if self._conn.broken:
                raise
            return None
        return job_id

    def probe(
        self, jobs: Sequence[models.StagedJob], kinds: Sequence[str] = PROBE_KINDS
    ) -> ProbeFailure | None:
        """Write each kind of settlement of these rows (DELETE, the retry UPDATE, the burial) in
        a savepoint, fire the deferred constraints, and roll back; a kind refused for them all
        at once is written for each row alone, until one takes it. The first kind no row takes,
        with why; None when each is taken by at least one row (a row refused alone is that row's
        matter: parked, drain.relay.loop), or there are no rows. Whatever the error: whether a row is
        refused alone is what the rows say, not its SQLSTATE. Changes nothing; the transaction
        stays usable. Raises only when the session is lost. (Without a row of its own,
        ``test_table``, the drain asks its due rows.)"""
        if not jobs:
            return None
        for kind in kinds:
            statement, items = self._writes(kind, jobs)
            why = self._try(statement, items)
            if why is None or (
                len(items) > 1 and any(self._try(statement, [item]) is None for item in items)
            ):
                continue
            return ProbeFailure(
                kind, why, "due rows" if len(items) == 1 else f"each of {len(items)} due rows"
            )
        return None

    def probe_due(
        self, limit: int, paused: Sequence[str], exclude: Sequence[int], kinds: Sequence[str]
    ) -> tuple[int, ProbeFailure | None]:
        """``probe`` the first ``limit`` due rows but ``exclude`` (and those of ``paused``
        backends), in a savepoint rolled back (their locks too): how many, and what failed."""
        with self._conn.transaction(force_rollback=True):
            jobs = self.select_due(limit, paused, exclude)
            return len(jobs), self.probe(jobs, kinds)

    def _writes(
        self, kind: str, jobs: Sequence[models.StagedJob]
    ) -> tuple[Callable[[Sequence[Any]], Done], list[Any]]:
        """The statement of a ``kind`` of settlement write, and its items for these rows."""
        if kind == DELETE:
            return self._delete, [(job.id, job.job_id) for job in jobs]
        if kind == RETRY:
            return self._record_failures, [
                settlement.Retry(job.id, job.job_id, 0, PROBE_ERROR, 0.0) for job in jobs
            ]
        return self._bury, [settlement.Dead(job, PROBE_ERROR, job.attempts) for job in jobs]

    def _try(self, statement: Callable[[Sequence[Any]], Done], items: Sequence[Any]) -> str | None:
        """Write ``items`` and roll back: why the table refused them, or None. Raises only when
        the session is lost."""
        try:
            with self._conn.transaction(force_rollback=True):
                changed, _ = statement(items)
                self.fire_deferred()
                if changed < len(items):
                    raise _Skipped(skipped(changed, len(items)))
        except (psycopg.Error, _Skipped) as exc:
            if self._conn.broken:
                raise
            return errors.first_line(exc)
        return None

    # --- the settlement's writes ----------------------------------------------------------------

    def _part(
        self, kind: str, statement: Callable[[Sequence[T]], Done], items: Sequence[T], *, careful: bool
    ) -> Refused:
        """Write one part of a settlement; return the rows refused, with why.

        Not ``careful``: one statement, an error propagates. ``careful``: in a savepoint; refused
        (whatever the error, while the session stays up), the table is tested first
        (``test_table``): if it refuses this kind of write of a row of its own too, the whole
        settlement fails (SettlementRefused); otherwise each row is written alone, so a refused
        row costs only its own write."""
        if not items:
            return {}
        if not careful:
            return self._unconfirmed(items, *statement(items))
        try:
            with self._conn.transaction():
                changed, done = statement(items)
        except (psycopg.Error, _Skipped) as exc:
            if self._conn.broken:
                raise
            if len(items) == 1:
                return {_key(items[0])[0]: Refusal(errors.first_line(exc), transient(exc))}
            failure = self.test_table([kind]).failure
            if failure is not None:
                raise errors.SettlementRefused(settling.refused_by_table(len(items), *failure)) from None
            refused: Refused = {}
            for item in items:
                refused |= self._part(kind, statement, [item], careful=True)
            return refused
        return self._unconfirmed(items, changed, done)

    def _unconfirmed(self, items: Sequence[Any], changed: int, done: set[int] | None) -> Refused:
        """The rows a statement left in place without an error: refused (those an app deleted
        meanwhile are gone, not refused)."""
        if done is None:
            if changed == len(items):
                return {}
            done = set()
        keys = [_key(item) for item in items if _key(item)[0] not in done]
        return dict.fromkeys(self.present(keys), Refusal(skipped(changed, len(items))))

    def _delete(self, keys: Sequence[Key]) -> Done:
        cursor = self._conn.execute(
            sql.query("delete_ids", self._names),
            {"ids": [key[0] for key in keys], "job_ids": [key[1] for key in keys]},
        )
        return cursor.rowcount, None

    def _record_failures(self, retries: Sequence[settlement.Retry]) -> Done:
        cursor = self._conn.execute(
            sql.query("record_failures", self._names),
            {
                "ids": [retry.row_id for retry in retries],
                "job_ids": [retry.job_id for retry in retries],
                "counted": [retry.counted for retry in retries],
                "errors": [retry.error for retry in retries],  # storable (settlement.decide)
                "delays": [retry.delay_s for retry in retries],
            },
        )
        done = {int(row[0]) for row in cursor.fetchall()}
        return len(done), done

    def _bury(self, dead: Sequence[settlement.Dead]) -> Done:
        """Copy the rows to the dead letters, then delete exactly the rows copied, in one
        savepoint: a count that does not match rolls both back (never a row deleted without its
        dead letter, nor a dead letter for a row left in place)."""
        with self._conn.transaction():
            cursor = self._conn.execute(
                sql.query("bury", self._names),
                {
                    "ids": [row.job.id for row in dead],
                    "job_ids": [row.job.job_id for row in dead],
                    "errors": [row.error for row in dead],
                },
            )
            copied: list[Key] = [(int(row[0]), row[1]) for row in cursor.fetchall()]
            deleted = self._delete(copied)[0] if copied else 0
            if deleted != len(copied):
                raise _Skipped(
                    f"the table deleted {deleted} of the {len(copied)} rows buried, without an error "
                    "(a trigger returning NULL, a rule, or a row-level security policy?)"
                )
        moved = {row_id for row_id, _ in copied}
        return len(moved), moved

    def limit_lock_wait(self, ms: int) -> None:
        """From now on in this transaction, a statement that waits for a lock longer than ``ms``
        (at least 1) fails with 55P03 (LockNotAvailable) instead."""
        self._lock_wait_ms = max(int(ms), 1)
        self._conn.execute(sql.query("limit_lock_wait", self._names), {"ms": str(self._lock_wait_ms)})

    def held(self, ids: Sequence[int]) -> set[int]:
        """Which of these rows another transaction holds a lock on (not waited for); this
        transaction locks the others."""
        if not ids:
            return set()
        cursor = self._conn.execute(sql.query("held_ids", self._names), {"ids": list(ids)})
        return {row[0] for row in cursor.fetchall()}


def transient(exc: BaseException) -> bool:
    """Whether a row's refused write may go through when written again: a serialization failure
    or a deadlock (class 40), a lock wait (55P03), a cancelled statement (57014). Such a row is
    held and tried again, never parked (drain.relay.loop); whether the *table* refuses is never
    decided by the error (Batch.test_table)."""
    sqlstate = getattr(exc, "sqlstate", None) or ""
    return sqlstate.startswith("40") or sqlstate in ("55P03", "57014")


def skipped(changed: int, asked: int) -> str:
    return (
        f"the statement changed {changed} of {asked} rows and left the others in place without an "
        "error (a trigger returning NULL, a rule, or a row-level security policy?)"
    )


def _key(item: Any) -> Key:
    if isinstance(item, settlement.Retry):
        return item.row_id, item.job_id
    if isinstance(item, settlement.Dead):
        return item.job.id, item.job.job_id
    return cast(Key, item)


class _Skipped(Exception):
    """A settlement statement left rows in place without an error (raised to roll it back)."""


# What the table's constraints raise: drain_job_check_v1 (checks.sql) 22023, a plain CHECK 23514.
_REFUSED_BY_TABLE = (psycopg.errors.InvalidParameterValue, psycopg.errors.CheckViolation)


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


def split_key(key: int) -> tuple[int, int]:
    """The (classid, objid) under which pg_locks shows a bigint advisory lock key."""
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF
