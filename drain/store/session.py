"""The relay's session: every database call the drain process makes, on one session it owns.

The lock, the batch reads and the deletes share this session: if it dies, Postgres releases the
leader lock *and* the pending deletes can no longer commit. The session runs in autocommit mode
(so holding the lock never leaves it idle in a transaction); each batch step is one explicit
REPEATABLE READ transaction that first checks the lock, so its SELECT and its DELETE see one
snapshot taken while leading (a pipelined batch is deleted, by explicit id, in a later step's
transaction). This module is the one place that sets an isolation level.

How the session connects: drain.store.connection. A settlement's writes: drain.store.writes;
the table's tests: drain.store.probing; a schedule pass's statements: drain.store.ticks. The
CLI's queries (status figures, dead letters, leader): drain.store.admin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import rows
from psycopg import sql as pgsql

from drain import errors, models
from drain.config import settings as config
from drain.store import connection, migrations, probing, reading, sql, ticks, writes

# The names the relay and the CLI know this module's values by (defined in drain.store.writes).
PARKED_AT = writes.PARKED_AT
PARKED_PREFIX = writes.PARKED_PREFIX
PARKED_IN_PLACE_PREFIX = writes.PARKED_IN_PLACE_PREFIX
DELETE, RETRY, BURY, SELECT = writes.DELETE, writes.RETRY, writes.BURY, writes.SELECT
PROBE_KINDS = writes.PROBE_KINDS
PROBE_LOCK_WAIT_MS = writes.PROBE_LOCK_WAIT_MS
Key = writes.Key
Refusal = writes.Refusal
Refused = writes.Refused
ProbeFailure = writes.ProbeFailure
TableTest = writes.TableTest
connect = connection.connect
split_key = connection.split_key
T = TypeVar("T")


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
        self.reader = reading.Reader(settings.batch_max_bytes, settings.dead_blocking())
        self._names_params = {"schema": settings.schema, "table": settings.table}  # the wake lock's
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

    def schedules_table_exists(self) -> bool:
        """Whether the schedules table exists (``drain migrate`` creates it)."""
        qualified = self.names.qualify(self.names.schedules)
        return bool(self._one("table_exists", {"qualified": qualified})["present"])

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
        return probing.settle_check(self.conn, self.names, self.schema_version)

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

    # --- the leader lock ------------------------------------------------------------------

    def try_lock(self, key: int) -> tuple[bool, int]:
        """Try the session-level advisory lock once; return (acquired, backend pid)."""
        row = self._one("try_lock", {"key": key})
        return bool(row["acquired"]), int(row["pid"])

    def name_session(self, name: str) -> None:
        """Set this session's application_name (drain.store.identity), unless the DSN or the
        environment (PGAPPNAME) chose one."""
        if "application_name" in connection.connection_kwargs(self.settings):
            self._one("set_application_name", {"name": name})

    def lock_held(self, key: int) -> tuple[bool, int]:
        """Whether this very session holds the lock, and its backend pid."""
        classid, objid = split_key(key)
        row = self._one("lock_held", {"classid": classid, "objid": objid, "relaxed": False})
        return bool(row["held"]), int(row["pid"])

    def lock_held_elsewhere(self, key: int) -> tuple[bool, int]:
        """The lock_held check on a second, brand-new session (connection.lock_held_elsewhere)."""
        return connection.lock_held_elsewhere(self.settings, self.names, key)

    def unlock(self, key: int) -> None:
        self._one("unlock", {"key": key})

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

    def status(
        self, cap: int | None = None, *, keys: bool = True, key_cap: int | None = None
    ) -> dict[str, Any]:
        """queries.sql ``status`` (and ``blocked``, capped by ``key_cap`` or ``cap``; None: exact)."""
        figures = self._one("status", {"cap": cap})
        keyed = {"cap": cap if key_cap is None else key_cap, "dead_blocking": self.reader.dead_blocking}
        return figures | self._one("blocked", keyed) if keys else figures

    # --- the wake-up (drain.relay.wakeup) -------------------------------------------------------

    def wake_arm(self) -> tuple[bool, str]:
        """Try to take the table's wake lock: (taken, the channel producers then notify)."""
        row = self._one("wake_arm", self._names_params)
        return bool(row["armed"]), str(row["channel"])

    def wake_disarm(self) -> None:
        self._one("wake_disarm", self._names_params)

    def anything_due(self) -> Due:
        """Whether a row is due, and when the earliest future one falls due."""
        row = self._one("anything_due", self.reader.idle_params())
        seconds = None if row["next_due_s"] is None else float(row["next_due_s"])
        return Due(bool(row["staged_now"]), bool(row["fell_due"]), seconds)

    def wake_trigger_enabled(self) -> bool:
        """Whether producers' INSERTs fire the wake-up trigger."""
        return bool(self._one("wake_trigger_enabled", {"qualified": self.names.qualified})["enabled"])

    def listen(self, channel: str) -> object:
        """LISTEN on ``channel`` on this session; return a token that changes when the session does."""
        conn = self.conn
        conn.execute(sql.query_with("listen", self.names, channel=pgsql.Identifier(channel)))
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
        self._writes = writes.Writes(conn, names)
        self._probe = probing.Probe(conn, names, self._writes)
        self.held_back = False
        """Whether the last select_due left due rows for want of budget (select again at once)."""

    def check_lock(self, key: int, pid: int) -> None:
        """Fence: raise unless this session is the backend that took the lock.

        Runs first in the batch, so the snapshot the batch reads under is one in which we lead.
        """
        classid, objid = split_key(key)
        params = {"classid": classid, "objid": objid, "relaxed": self._relaxed}
        row = self._conn.execute(sql.query("lock_held", self._names), params).fetchone()
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
        statement = sql.positional("select_due", self._names)
        params = {"paused": list(paused), "exclude": list(exclude), **self._reader.params(limit, budget)}
        with psycopg.RawCursor(self._conn) as cursor:
            cursor.execute(statement.text, statement.params(params))
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
        return self._part(
            DELETE, self._writes.delete, [(job.id, job.job_id) for job in jobs], careful=careful
        )

    def record_failures(self, retries: Sequence[writes.Retry]) -> Refused:
        """Push failed rows back by their delay, adding what each counts to its attempts; return
        those the table refused. Carefully (``_part``): a refused backoff never undoes the rest
        of the settlement."""
        return self._part(RETRY, self._writes.record_failures, retries, careful=True)

    def bury(self, dead: Sequence[writes.Dead]) -> Refused:
        """Move rows to the dead-letter table with their error; return those refused (by the
        table, or by the dead letters: a row is never deleted without its dead letter).
        Carefully (``_part``)."""
        return self._part(BURY, self._writes.bury, dead, careful=True)

    def park(self, job: models.StagedJob, error: str) -> bool:
        """Park a row whose settlement the table refused: ``run_at`` PARKED_AT (no select takes it
        again) and ``error`` (which starts with PARKED_PREFIX) in last_error, in a savepoint;
        False if the table refuses that too (whatever the error, while the session stays up)."""
        params = {"id": job.id, "job_id": job.job_id, "parked_at": PARKED_AT, "error": writes.storable(error)}
        return self._writes.park("park", params)

    def park_in_place(self, job: models.StagedJob, error: str) -> bool:
        """Park a row whose parking the table refused too: only its last_error, ``error`` (which
        starts with PARKED_IN_PLACE_PREFIX; no select takes such a row again), its run_at left as
        it is, in a savepoint; False if the table refuses that too (the row is then held by the
        process, drain.relay.settling.Unsettled)."""
        params = {"id": job.id, "job_id": job.job_id, "error": writes.storable(error)}
        return self._writes.park("park_in_place", params)

    def fire_deferred(self) -> None:
        """Run deferred constraint triggers at each statement from now on, not at COMMIT."""
        self._writes.fire_deferred()

    def present(self, keys: Sequence[Key]) -> list[int]:
        """Which of these rows (id, job_id) are in the table."""
        return self._writes.present(keys)

    @property
    def schedules(self) -> ticks.Ticks:
        """A schedule pass's statements in this transaction (drain.relay.schedules)."""
        return ticks.Ticks(self._conn, self._names)

    # --- does the table take settlements? (drain.store.probing) --------------------------------

    def test_table(self, kinds: Sequence[str] = PROBE_KINDS) -> TableTest:
        """Whether the table itself takes these kinds of settlement write, whichever rows a
        settlement names, asked of a row of the drain's own (drain.store.probing.Probe.test_table);
        remembered for this transaction. Raises only when the session is lost."""
        return self._probe.test_table(kinds)

    def probe(
        self, jobs: Sequence[models.StagedJob], kinds: Sequence[str] = PROBE_KINDS
    ) -> ProbeFailure | None:
        """Whether these rows take each kind of settlement, rolled back: the first kind no row
        takes, with why (drain.store.probing.Probe.probe). Raises only when the session is lost."""
        return self._probe.probe(jobs, kinds)

    def probe_due(
        self, limit: int, paused: Sequence[str], exclude: Sequence[int], kinds: Sequence[str]
    ) -> tuple[int, ProbeFailure | None]:
        """``probe`` the first ``limit`` due rows but ``exclude`` (and those of ``paused``
        backends), in a savepoint rolled back (their locks too): how many, and what failed."""
        with self._conn.transaction(force_rollback=True):
            jobs = self.select_due(limit, paused, exclude)
            return len(jobs), self.probe(jobs, kinds)

    # --- the settlement's writes ----------------------------------------------------------------

    def _part(
        self, kind: str, statement: Callable[[Sequence[T]], writes.Done], items: Sequence[T], *, careful: bool
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
        except (psycopg.Error, writes.Skipped) as exc:
            if self._conn.broken:
                raise
            if len(items) == 1:
                return {writes.key(items[0])[0]: Refusal(errors.first_line(exc), writes.transient(exc))}
            failure = self.test_table([kind]).failure
            if failure is not None:
                raise errors.SettlementRefused(writes.refused_by_table(len(items), *failure)) from None
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
        keys = [writes.key(item) for item in items if writes.key(item)[0] not in done]
        return dict.fromkeys(self.present(keys), Refusal(writes.skipped(changed, len(items))))

    def limit_lock_wait(self, ms: int) -> None:
        """From now on in this transaction, a statement that waits for a lock longer than ``ms``
        (at least 1) fails with 55P03 (LockNotAvailable) instead."""
        self._probe.lock_wait_ms = max(int(ms), 1)
        self._conn.execute(sql.query("limit_lock_wait", self._names), {"ms": str(self._probe.lock_wait_ms)})

    def held(self, ids: Sequence[int]) -> set[int]:
        """Which of these rows another transaction holds a lock on (not waited for); this
        transaction locks the others."""
        if not ids:
            return set()
        cursor = self._conn.execute(sql.query("held_ids", self._names), {"ids": list(ids)})
        return {row[0] for row in cursor.fetchall()}
