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
import logging
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import conninfo, rows
from psycopg import sql as pgsql
from psycopg.types import json as pg_json

from drain import config, errors, logs, models, settlement, sql, tracing

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5
KEEPALIVES_IDLE_S = 5
KEEPALIVES_INTERVAL_S = 2
KEEPALIVES_COUNT = 3
TCP_USER_TIMEOUT_MS = 10_000
APPLICATION_NAME = "drain"
_NO_NAMES = sql.Names("public", "unused")  # for the statements that name no table


def idle_in_transaction_timeout_ms(publish_timeout_s: float) -> int:
    """The server-side fence for a hung publish: well above the publish deadline.

    If a publish outlives it, Postgres ends the session, which releases the lock and makes the
    batch's delete impossible: the rows are published again by the next leader (a duplicate,
    never a loss).
    """
    return int(max(3 * publish_timeout_s, publish_timeout_s + 10.0) * 1000)


def connection_kwargs(settings: config.Settings) -> dict[str, Any]:
    """libpq parameters for the drain's session; a parameter set in the DSN wins.

    The timeouts are not among them: :func:`connect` SETs them after connecting and reads them
    back, because a pooler may drop a startup ``options`` parameter without a word.
    """
    present = conninfo.conninfo_to_dict(settings.dsn) if settings.dsn else {}
    wanted: dict[str, Any] = {
        "application_name": APPLICATION_NAME,
        "connect_timeout": CONNECT_TIMEOUT_S,
        "keepalives": 1,
        "keepalives_idle": KEEPALIVES_IDLE_S,
        "keepalives_interval": KEEPALIVES_INTERVAL_S,
        "keepalives_count": KEEPALIVES_COUNT,
        "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
    }
    return {key: value for key, value in wanted.items() if key not in present}


def session_timeouts_ms(settings: config.Settings) -> dict[str, int]:
    """The timeouts the drain's session must run with, in milliseconds."""
    return {
        "statement_timeout": int(settings.statement_timeout_s * 1000),
        "idle_timeout": idle_in_transaction_timeout_ms(settings.publish_timeout_s),
    }


def connect(settings: config.Settings, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    """Open a session with the drain's keepalives and timeouts, the timeouts verified.

    Raises DrainError with a one-line reason (password redacted) when it cannot connect or the
    session does not keep the timeouts it was given.
    """
    where = logs.redact(settings.dsn) or "(libpq defaults)"  # also a DSN urllib cannot parse
    try:
        conn = psycopg.connect(settings.dsn, autocommit=True, **connection_kwargs(settings))
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:  # a malformed DSN: libpq quotes it
        reason = logs.redact(errors.first_line(exc))
        raise errors.DrainError(f"cannot connect to the database {where}: {reason}") from None
    try:
        wanted = session_timeouts_ms(settings)
        conn.execute(sql.query("set_timeouts", _NO_NAMES), {k: str(v) for k, v in wanted.items()})
        row = conn.execute(sql.query("session_timeouts", _NO_NAMES)).fetchone()
        got = dict(zip(("statement_timeout", "idle_timeout"), row or (), strict=False))
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


class Store:
    """The drain's database session. Not thread-safe; the relay uses it from one thread."""

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self.names = sql.Names(settings.schema, settings.table)
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.settings)
            # Statements outside a block stay autocommit; every transaction block (a batch) opens
            # with BEGIN ISOLATION LEVEL REPEATABLE READ, in one round trip.
            self._conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        return self._conn

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

    def migrate(self) -> None:
        """Create the table, its indexes, the dead-letter table and the SQL staging function; idempotent."""
        with self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(hashtext('drain:migrate'))")
            self.conn.execute(sql.schema(self.names))
            self.conn.execute(sql.functions(self.names))

    def table_exists(self) -> bool:
        return bool(self._one("table_exists", {"qualified": self.names.qualified})["present"])

    def require_table(self) -> None:
        if not self.table_exists():
            raise errors.SchemaError(f"table {self.names.qualified} does not exist; run `drain migrate`")

    # --- the leader lock ------------------------------------------------------------------

    def try_lock(self, key: int) -> tuple[bool, int]:
        """Try the session-level advisory lock once; return (acquired, backend pid)."""
        row = self._one("try_lock", {"key": key})
        return bool(row["acquired"]), int(row["pid"])

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
            yield Batch(conn, self.names, relaxed=relaxed)

    def seconds_until_due(self) -> float | None:
        """Seconds until the earliest future row falls due (database clock), or None."""
        value = self._one("seconds_until_due")["seconds"]
        return None if value is None else float(value)

    def status(self, cap: int | None = None) -> dict[str, Any]:
        """due, future, backlog, oldest_due_age_s, dead: the CLI's figures and the leader's gauges.

        Each count walks an index and stops at ``cap`` rows (None: exact, for the CLI).
        """
        return self._one("status", {"cap": cap})

    # --- the wake-up (drain.wakeup) -------------------------------------------------------

    def _wake_names(self) -> dict[str, Any]:
        return {"schema": self.settings.schema, "table": self.settings.table}

    def wake_arm(self) -> tuple[bool, str]:
        """Try to take the table's wake lock: (taken, the channel producers then notify)."""
        row = self._one("wake_arm", self._wake_names())
        return bool(row["armed"]), str(row["channel"])

    def wake_disarm(self) -> None:
        self._one("wake_disarm", self._wake_names())

    def anything_due(self) -> tuple[bool, bool]:
        """Whether a row is due: (one staged for now, one whose run_at has passed)."""
        row = self._one("anything_due")
        return bool(row["staged_now"]), bool(row["fell_due"])

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
        (0 on timeout). Those that arrived during earlier statements count at once."""
        return sum(1 for _ in self.conn.notifies(timeout=max(timeout_s, 0.0), stop_after=1))

    # --- dead letters ---------------------------------------------------------------------

    def dead_list(self, filters: DeadFilter) -> list[dict[str, Any]]:
        """Dead letters matching ``filters``, oldest first."""
        with self.conn.cursor(row_factory=rows.dict_row) as cursor:
            cursor.execute(sql.query("dead_list", self.names), filters.params())
            return cursor.fetchall()

    def dead_retry(self, filters: DeadFilter) -> int:
        """Move matching dead letters back to the table in one transaction; return how many.

        Each gets a new row id, keeps its job_id, and is due now with attempts reset. A dead
        letter whose job_id is staged again already stays where it is.
        """
        with self.conn.transaction(), self.conn.cursor() as cursor:
            cursor.execute(sql.query("dead_retry", self.names), filters.params())
            return len(cursor.fetchall())

    def dead_purge(self, filters: DeadFilter) -> int:
        """Delete matching dead letters; return how many."""
        with self.conn.transaction(), self.conn.cursor() as cursor:
            cursor.execute(sql.query("dead_purge", self.names), filters.params())
            return len(cursor.fetchall())


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

    def __init__(self, conn: psycopg.Connection[Any], names: sql.Names, *, relaxed: bool = False) -> None:
        self._conn = conn
        self._names = names
        self._relaxed = relaxed

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
        self, limit: int, paused: Sequence[str] = (), exclude: Sequence[int] = ()
    ) -> list[models.StagedJob]:
        """Up to ``limit`` due rows in id order, except those of ``paused`` backends and the
        ``exclude`` ids (a batch still in flight)."""
        if limit <= 0:
            return []
        with self._conn.cursor() as cursor:
            cursor.adapters.register_loader("jsonb", _JobJsonbLoader)
            cursor.execute(
                sql.query("select_due", self._names),
                {"limit": limit, "paused": list(paused), "exclude": list(exclude)},
            )
            read_at = time.monotonic()
            return [_staged_job(row, read_at) for row in cursor.fetchall()]

    def delete(self, ids: Sequence[int]) -> int:
        """Delete exactly these rows (never a range: ids commit out of order)."""
        if not ids:
            return 0
        cursor = self._conn.execute(sql.query("delete_ids", self._names), {"ids": list(ids)})
        return cursor.rowcount

    def record_failures(self, retries: Sequence[settlement.Retry]) -> None:
        """Push failed rows back by their delay, adding what each counts to its attempts."""
        if not retries:
            return
        self._conn.execute(
            sql.query("record_failures", self._names),
            {
                "ids": [retry.row_id for retry in retries],
                "counted": [retry.counted for retry in retries],
                "errors": [retry.error for retry in retries],
                "delays": [retry.delay_s for retry in retries],
            },
        )

    def bury(self, dead: Sequence[settlement.Dead]) -> None:
        """Move rows to the dead-letter table with their error, in this transaction."""
        if not dead:
            return
        self._conn.execute(
            sql.query("bury", self._names),
            {"ids": [row.job.id for row in dead], "errors": [row.error for row in dead]},
        )


_NO_KWARGS: Mapping[str, Any] = types.MappingProxyType({})


class _JobJsonbLoader(pg_json.JsonbLoader):
    """jsonb for the batch select: the usual empty ``'{}'`` and ``'[]'`` skip the JSON parser and
    come back as shared read-only empties (a StagedJob's args, kwargs and options are read-only)."""

    def load(self, data: Any) -> Any:
        if data == b"{}":
            return _NO_KWARGS
        if data == b"[]":
            return ()
        return super().load(data)


def _staged_job(row: Sequence[Any], read_at: float) -> models.StagedJob:
    """A ``select_due`` row as a job. The reserved trace keys leave its options here, before any
    adapter checks them (drain.tracing)."""
    options, traceparent, tracestate = tracing.split(row[7], row[0], row[1])
    return models.StagedJob(
        id=row[0],
        job_id=row[1],
        job_name=row[2],
        args=row[3],
        kwargs=row[4],
        queue=row[5],
        backend=row[6],
        options=options,
        created_at=row[8],
        attempts=row[9],
        run_at=row[10],
        age_s=row[11],
        read_at=read_at,
        traceparent=traceparent,
        tracestate=tracestate,
    )


def split_key(key: int) -> tuple[int, int]:
    """The (classid, objid) under which pg_locks shows a bigint advisory lock key."""
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF
