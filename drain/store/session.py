"""The relay's session: every database call the drain process makes, on one session it owns.

The session
-----------
- The lock, the batch reads and the deletes share it. If it dies, Postgres releases the leader
  lock, and the deletes can no longer commit.
- It runs in autocommit mode: holding the lock never leaves it idle in a transaction.
- Each step is one REPEATABLE READ transaction (a Batch) that first checks the lock. Its SELECT
  and its DELETE see one snapshot, taken while leading.
- A pipelined batch is deleted, by explicit id, in a later step's transaction.
- An operator's writes run READ COMMITTED instead (drain.store.admin, its Racing section).

Around it
---------
- how the session connects: drain.store.connection;
- what a select makes of its rows: drain.store.reading;
- the values a settlement's writes take: drain.store.writes;
- the CLI's queries (status figures, dead letters, leader): drain.store.admin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import rows
from psycopg import sql as pgsql

from drain import errors, models
from drain.config import settings as config
from drain.store import connection, migrations, reading, sql, writes

log = logging.getLogger(__name__)

T = TypeVar("T")

SETTLE_TABLE_PRIVILEGES = ("SELECT", "UPDATE", "DELETE")
SETTLE_DEAD_PRIVILEGES = ("SELECT", "INSERT")
SETTLE_VERSIONS_PRIVILEGES = ("SELECT",)


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
        self._wake_slot: int | None = None  # the wake lock wake_arm took
        self._conn: psycopg.Connection[Any] | None = None
        self._lanes_version: str | None = None  # the lanes function's, when last found serving
        self._lanes_failed: str | None = None  # the version a select through the index failed with

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connection.connect(self.settings)
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
        with connection.connect(self.settings) as conn:
            conn.execute(migrations.statement("no_statement_timeout", self.names))
            slots = migrations.wake_slots(self.settings.lanes)
            runner = migrations.Autocommit(conn)
            return migrations.upgrade(runner, self.names, wake_slots=slots, lanes=self.settings.lanes)

    def schema_version(self) -> int:
        """The table's schema version (drain.store.migrations): 0 without a table, 1 for drain 0.1.0's."""
        return migrations.current_version(migrations.Autocommit(self.conn), self.names)

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

    # --- can this session settle? (drain.relay.leadership) ---------------------------------------

    def settle_check(self) -> dict[str, Any]:
        """What stands in the way of a settlement here (``settle_check`` in queries.sql).

        - in_recovery, read_only, role;
        - the privileges a settlement needs that the role lacks: table_missing, dead_missing,
          versions_missing (lists of privilege names);
        - the three tables' quoted names: table, dead, versions;
        - the table's schema_version (None when the role may not read it), and the
          latest_version this drain writes for.
        """
        names = self.names
        dead = pgsql.Identifier(names.schema, names.dead).as_string(self.conn)
        versions = pgsql.Identifier(names.schema, names.versions).as_string(self.conn)
        row = self._one(
            "settle_check",
            {
                "table": names.qualified,
                "dead": dead,
                "versions": versions,
                "table_privileges": list(SETTLE_TABLE_PRIVILEGES),
                "dead_privileges": list(SETTLE_DEAD_PRIVILEGES),
                "versions_privileges": list(SETTLE_VERSIONS_PRIVILEGES),
            },
        )
        version = None if row["versions_missing"] else self.schema_version()
        return {
            **row,
            "table": names.qualified,
            "dead": dead,
            "versions": versions,
            "schema_version": version,
            "latest_version": migrations.LATEST_VERSION,
        }

    def probe_settlement(self, limit: int) -> writes.ProbeFailure | None:
        """Whether the table takes every kind of settlement, all rolled back: the kind refused
        and why, or None.

        - First on a row of the drain's own (Batch.test_table).
        - Without one, on the first ``limit`` due rows, as a first batch would take them
          (Batch.probe): the probe costs what one batch costs.
        - Raises when the session is lost, or the due rows cannot be read.
        """
        with self.conn.transaction(force_rollback=True):
            batch = Batch(self.conn, self.names, self.reader)
            batch.limit_lock_wait(writes.PROBE_LOCK_WAIT_MS)
            test = batch.test_table(writes.PROBE_KINDS)
            if isinstance(test, writes.ProbeFailure):
                return test
            return None if test else batch.probe(batch.select_due(limit))

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
        pid, held = _lock_held(self.conn, self.names, key)
        return held, pid

    def lock_held_elsewhere(self, key: int, *, shared: bool = False) -> tuple[bool, int]:
        """The lock_held check on a brand-new session: (held there, its backend pid).

        Directly or through a session pool, that session is another backend, without our lock. A
        transaction pool hands out the backend our last statement ran on (LIFO): the one holding
        the lock. The probe then unlocks it (``shared``: a member's, drain.relay.lanes), or the pool
        would keep it orphaned there.
        """
        with connection.connect(self.settings) as probe:
            pid, held = _lock_held(probe, self.names, key)
            if held:
                probe.execute(sql.query("unlock_shared" if shared else "unlock", self.names), {"key": key})
        return held, pid

    def unlock(self, key: int) -> None:
        self._one("unlock", {"key": key})

    def try_lock_shared(self, key: int) -> tuple[bool, int]:
        """try_lock, shared: a member of a table with lanes (drain.relay.lanes)."""
        row = self._one("try_lock_shared", {"key": key})
        return bool(row["acquired"]), int(row["pid"])

    def unlock_shared(self, key: int) -> None:
        self._one("unlock_shared", {"key": key})

    def try_lane(self, space: int, lane: int, *, shared: bool = False) -> bool:
        """Try one lock of a table's lane key space once (drain.relay.lanes)."""
        return bool(self._one("lane_lock", {"space": space, "lane": lane, "shared": shared})["acquired"])

    def unlock_lane(self, space: int, lane: int, *, shared: bool = False) -> None:
        self._one("lane_unlock", {"space": space, "lane": lane, "shared": shared})

    def lane_holders(self, space: int) -> list[tuple[int, int, bool, float | None]]:
        """Every lock held in a table's lane key space: (backend pid, lane, shared, seconds its
        session has run no statement, or None)."""
        with self.conn.cursor() as cursor:
            cursor.execute(sql.query("lane_holders", self.names), {"space": space})
            return [
                (int(pid), int(lane), bool(shared), None if quiet is None else float(quiet))
                for pid, lane, shared, quiet in cursor.fetchall()
            ]

    def lane_sessions(self, space: int) -> list[dict[str, Any]]:
        """lane_holders with each holder's session, as `drain status` names it: pid, lane, shared,
        application_name, client_addr, backend_start."""
        with self.conn.cursor(row_factory=rows.dict_row) as cursor:
            cursor.execute(sql.query("lane_sessions", self.names), {"space": space})
            return cursor.fetchall()

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
            yield Batch(conn, self.names, self.reader, relaxed=relaxed)

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

    def lanes_index_ready(self, lanes: int) -> bool:
        """Whether members of ``lanes`` lanes can read their own lanes' rows through the lanes index
        and function of that count (:meth:`lanes_index_problem` finds none)."""
        return self.lanes_index_problem(lanes) is None

    def lanes_index_problem(self, lanes: int) -> str | None:
        """Why members of ``lanes`` lanes cannot read their own lanes' rows through the lanes index
        and function of that count (``drain migrate`` with that lanes setting builds them); None
        when they can: the index valid, the function as this drain creates it and runnable by
        this session with its own rights, and an index giving each lane's rows in id order (an
        index of the name but another definition does not). A version of the function a select
        failed with is not tried again (Batch.select_due)."""
        row = self.conn.execute(migrations.lanes_statement("lanes_ready", self.names, lanes)).fetchone()
        assert row is not None
        index_valid, function_there, runnable, body, settings, version = row
        if self.reader.lanes_failed:  # a select through it failed: not that version again
            self.reader.lanes_failed, self._lanes_failed = False, self._lanes_version
        if not index_valid:
            return "the index is missing, or invalid (a build that failed)"
        if not function_there:
            return "the function is missing"
        if not runnable:
            return "this role may not run the function with its own rights"
        if (body, list(settings or ())) != migrations.lanes_function_source(self.names, lanes):
            return "the function is not the one this drain version creates (another version's, or edited)"
        if version == self._lanes_failed:
            return "a select through the function failed"
        self._lanes_version = version
        explain = migrations.lanes_statement("lanes_plan", self.names, lanes)
        with self.conn.transaction(force_rollback=True):
            self.conn.execute(migrations.statement("lanes_plan_settings", self.names))
            planned = self.conn.execute(explain).fetchone()
        assert planned is not None
        plan = planned[0] if isinstance(planned[0], list) else json.loads(planned[0])
        if not _reads_in_order(plan[0]["Plan"]):
            return "no index gives each lane's rows in id order (an index of the name but another definition)"
        return None

    def lane_backlog(self, lane_count: int, cap: int | None = None) -> list[dict[str, Any]]:
        """queries.sql ``lane_backlog``: each lane with due rows (lane, due, deferred,
        oldest_due_age_s), over ``lane_count`` lanes, each branch capped by ``cap`` (None: exact)."""
        with self.conn.cursor(row_factory=rows.dict_row) as cursor:
            cursor.execute(sql.query("lane_backlog", self.names), {"cap": cap, "lane_count": lane_count})
            return cursor.fetchall()

    # --- the wake-up (drain.relay.wakeup) -------------------------------------------------------

    def wake_arm(self, slots: int = 1) -> tuple[bool, str]:
        """Try to take a wake lock of the table, the first free of ``slots`` (the triggers' wake
        slots, :meth:`wake_trigger`): (taken, the channel producers then notify)."""
        row = self._one("wake_arm", {**self._names_params, "slots": slots})
        self._wake_slot = None if row["slot"] is None else int(row["slot"])
        return self._wake_slot is not None, str(row["channel"])

    def wake_disarm(self) -> None:
        """Release the wake lock :meth:`wake_arm` took."""
        self._one("wake_disarm", {**self._names_params, "slot": self._wake_slot or 0})

    def anything_due(self) -> Due:
        """Whether a row is due, and when the earliest future one falls due."""
        row = self._one("anything_due", self.reader.idle_params())
        seconds = None if row["next_due_s"] is None else float(row["next_due_s"])
        return Due(bool(row["staged_now"]), bool(row["fell_due"]), seconds)

    def wake_trigger_enabled(self) -> bool:
        """Whether producers' INSERTs fire the wake-up trigger."""
        return self.wake_trigger()[0]

    def wake_trigger(self) -> tuple[bool, int]:
        """Whether producers' INSERTs fire the wake-up trigger, and its wake slots (1 without lanes)."""
        row = self._one("wake_trigger_enabled", {"qualified": self.names.qualified})
        return bool(row["enabled"]), int(row["slots"])

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
    """The statements of one batch transaction: the select, the settlement's writes, the table's tests.

    - Every write names its row by id *and* job_id: an id reused since it was read is another job.
    - The table's tests (``test_table``, ``probe``) write and roll back: nothing changes.
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        names: sql.Names,
        reader: reading.Reader,
        *,
        relaxed: bool = False,
    ) -> None:
        self._conn = conn
        self._names = names
        self._relaxed = relaxed
        self._reader = reader
        self._tests: dict[str, writes.ProbeFailure | bool] = {}  # test_table's findings, by kind
        self._lock_wait_ms = writes.PROBE_LOCK_WAIT_MS  # limit_lock_wait's: a test waits no longer
        self.over_budget = False
        """Whether the last select_due left due rows for want of budget (select again at once)."""

    def check_lock(self, key: int, pid: int) -> None:
        """Fence: raise unless this session is the backend that took the lock.

        Runs first in the batch, so the snapshot the batch reads under is one in which we lead.
        """
        current_pid, held = _lock_held(self._conn, self._names, key, relaxed=self._relaxed)
        _fence(pid, current_pid, held, "the leader lock")

    def check_lanes(self, space: int, lanes: Sequence[int], pid: int) -> None:
        """check_lock for a drain leading ``lanes`` of a table's lane key space: raise unless this
        session is backend ``pid`` and still holds every one of them."""
        params = {"space": space, "lanes": _array_text(lanes), "relaxed": self._relaxed}
        row = self._conn.execute(sql.query("lanes_held", self._names), params).fetchone()
        assert row is not None
        _fence(pid, int(row[0]), int(row[1]) == len(lanes), "all of its lanes")

    def select_due(
        self,
        limit: int,
        paused: Sequence[str] = (),
        exclude: Sequence[int] = (),
        budget_bytes: int | None = None,
    ) -> list[models.StagedJob]:
        """Up to ``limit`` due rows in id order, within ``budget_bytes`` of decoded weight.

        - Not the rows of ``paused`` backends, nor the ``exclude`` ids (in flight, or held).
        - The budget defaults to the whole ``batch_max_bytes`` (drain.store.reading).
        - A row that cannot be read is a job with ``unreadable`` set.
        - Rows that do not fit wait for the next select (``over_budget``).
        - Raises only for the database, never for what a row holds.
        """
        self.over_budget = False
        if limit <= 0:
            return []
        budget = self._reader.batch_max_bytes if budget_bytes is None else budget_bytes
        params = {"paused": list(paused), "exclude": _array_text(exclude)}
        params.update(self._reader.params(limit, budget))
        lane_count = self._reader.indexed_lanes() if params["window"] is not None else None
        statement = sql.positional("select_due", self._names, lane_count)
        with psycopg.RawCursor(self._conn) as cursor:
            try:
                cursor.execute(statement.text, statement.params(params))
            except psycopg.Error as exc:
                if lane_count is not None and not self._conn.broken:
                    _walk_unless_a_row_changed(self._reader, exc)
                raise
            read_at = time.monotonic()
            fetched = cursor.fetchall()
        taken = self._reader.take(fetched, budget, read_at)
        self.over_budget = taken.over_budget
        return taken.jobs

    def locked(self, ids: Sequence[int]) -> set[int]:
        """Which of these rows another transaction locks (not waited for); this one locks the rest."""
        if not ids:
            return set()
        cursor = self._conn.execute(sql.query("held_ids", self._names), {"ids": list(ids)})
        return {row[0] for row in cursor.fetchall()}

    def limit_lock_wait(self, ms: int) -> None:
        """From now on in this transaction, a statement that waits for a lock longer than ``ms``
        (at least 1) fails with 55P03 (LockNotAvailable) instead."""
        self._lock_wait_ms = max(int(ms), 1)
        self._conn.execute(sql.query("limit_lock_wait", self._names), {"ms": str(self._lock_wait_ms)})

    def fire_deferred(self) -> None:
        """Run deferred constraint triggers at each statement from now on, not at COMMIT."""
        self._conn.execute(sql.query("fire_deferred", self._names))

    @property
    def schedules(self) -> Ticks:
        """A schedule pass's statements in this transaction (drain.relay.schedules)."""
        return Ticks(self._conn, self._names)

    # --- the settlement's three parts -----------------------------------------------------------

    def delete(self, jobs: Sequence[models.StagedJob], *, careful: bool = False) -> writes.Refused:
        """Delete exactly these rows; return those the table refused, with why.

        - Each row by its id and job_id, never a range: ids commit out of order.
        - A row left in place without an error (a trigger returning NULL, a rule, a row-level
          security policy) is refused. One an app deleted meanwhile is simply gone.
        - Not ``careful``, an error propagates: the relay writes the settlement again, carefully.
        """
        keys = [(job.id, job.job_id) for job in jobs]
        return self._part(writes.DELETE, self._delete_statement, keys, careful=careful)

    def record_failures(self, retries: Sequence[writes.Retry]) -> writes.Refused:
        """Push failed rows back by their delay, adding what each counts to its attempts; return
        those the table refused. Carefully: a refused backoff never undoes the rest."""
        return self._part(writes.RETRY, self._retry_statement, retries, careful=True)

    def bury(self, dead: Sequence[writes.Dead]) -> writes.Refused:
        """Move rows to the dead-letter table with their error; return those refused, carefully.
        A row is never deleted without its dead letter."""
        return self._part(writes.BURY, self._bury_statement, dead, careful=True)

    def _part(
        self, kind: str, statement: Callable[[Sequence[T]], writes.Done], items: Sequence[T], *, careful: bool
    ) -> writes.Refused:
        """Write one part of a settlement; return the rows refused, with why.

        - Not ``careful``: one statement; an error propagates.
        - ``careful``: in a savepoint. Refused (whatever the error, while the session stays up),
          the table is tested first (``test_table``). If it refuses this kind of write of a row
          of its own too, the whole settlement fails (SettlementRefused). Otherwise each row is
          written alone, so a refused row costs only its own write.
        """
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
                return {
                    writes.key(items[0])[0]: writes.Refusal(
                        why=errors.first_line(exc), transient=writes.transient(exc)
                    )
                }
            failure = self.test_table([kind])
            if isinstance(failure, writes.ProbeFailure):
                raise errors.SettlementRefused(writes.refused_by_table(len(items), *failure)) from None
            refused: writes.Refused = {}
            for item in items:
                refused |= self._part(kind, statement, [item], careful=True)
            return refused
        return self._unconfirmed(items, changed, done)

    def _unconfirmed(self, items: Sequence[Any], changed: int, done: set[int] | None) -> writes.Refused:
        """The rows a statement left in place without an error: refused. Those an app deleted
        meanwhile are gone, not refused."""
        if done is None:
            if changed == len(items):
                return {}
            done = set()
        keys = [writes.key(item) for item in items if writes.key(item)[0] not in done]
        return dict.fromkeys(self.present(keys), writes.Refusal(why=writes.skipped(changed, len(items))))

    def present(self, keys: Sequence[writes.Key]) -> list[int]:
        """Which of these rows (id, job_id) are in the table."""
        if not keys:
            return []
        cursor = self._conn.execute(sql.query("present_ids", self._names), _key_params(keys))
        return [int(row[0]) for row in cursor.fetchall()]

    def _delete_statement(self, keys: Sequence[writes.Key]) -> writes.Done:
        cursor = self._conn.execute(sql.query("delete_ids", self._names), _key_params(keys))
        return cursor.rowcount, None

    def _retry_statement(self, retries: Sequence[writes.Retry]) -> writes.Done:
        cursor = self._conn.execute(
            sql.query("record_failures", self._names),
            {
                "ids": [retry.row_id for retry in retries],
                "job_ids": [retry.job_id for retry in retries],
                "counted": [retry.counted for retry in retries],
                "errors": [retry.error for retry in retries],  # storable (drain.relay.settle.decide)
                "delays": [retry.delay_s for retry in retries],
            },
        )
        done = {int(row[0]) for row in cursor.fetchall()}
        return len(done), done

    def _bury_statement(self, dead: Sequence[writes.Dead]) -> writes.Done:
        """Copy the rows to the dead letters, then delete exactly the rows copied, in one
        savepoint. A count that does not match rolls both back: never a row deleted without its
        dead letter, nor a dead letter for a row left in place."""
        with self._conn.transaction():
            cursor = self._conn.execute(
                sql.query("bury", self._names),
                {
                    "ids": [row.job.id for row in dead],
                    "job_ids": [row.job.job_id for row in dead],
                    "errors": [row.error for row in dead],
                },
            )
            copied: list[writes.Key] = [(int(row[0]), row[1]) for row in cursor.fetchall()]
            deleted = self._delete_statement(copied)[0] if copied else 0
            if deleted != len(copied):
                raise writes.Skipped(
                    f"the table deleted {deleted} of the {len(copied)} rows buried, without an error "
                    "(a trigger returning NULL, a rule, or a row-level security policy?)"
                )
        moved = {row_id for row_id, _ in copied}
        return len(moved), moved

    # --- parking ----------------------------------------------------------------------------------

    def park(self, job: models.StagedJob, error: str) -> bool:
        """Park a row whose settlement the table refused, in a savepoint: ``run_at`` PARKED_AT (no
        select takes it again), last_error ``error`` (PARKED_PREFIX ...). False if refused too."""
        params = {"id": job.id, "job_id": job.job_id, "error": writes.storable(error)}
        return self._park("park", params | {"parked_at": writes.PARKED_AT})

    def park_in_place(self, job: models.StagedJob, error: str) -> bool:
        """Park a row whose parking the table refused too, in a savepoint.

        Only its last_error is written: ``error``, which starts with PARKED_IN_PLACE_PREFIX. No
        select takes such a row again; its run_at stays. False if the table refuses that too:
        the process then holds the row (drain.relay.settle.Held).
        """
        error = writes.storable(error)
        return self._park("park_in_place", {"id": job.id, "job_id": job.job_id, "error": error})

    def _park(self, name: str, params: dict[str, Any]) -> bool:
        """Run ``park`` or ``park_in_place`` in a savepoint: whether it changed the row. False if
        the table refuses it, whatever the error, while the session stays up."""
        try:
            with self._conn.transaction():
                cursor = self._conn.execute(sql.query(name, self._names), params)
        except psycopg.Error:
            if self._conn.broken:
                raise
            return False
        return cursor.rowcount == 1

    # --- does the table take settlements? -------------------------------------------------------

    def test_table(self, kinds: Sequence[str] = writes.PROBE_KINDS) -> writes.ProbeFailure | bool:
        """Whether the table itself takes these kinds of settlement write, whichever row they name.

        - First the lock every write takes, within PROBE_LOCK_WAIT_MS at most.
        - Then, if this role may INSERT, a row of the drain's own (PROBE_JOB_NAME, a negative
          id). Its SELECT must see it; each kind of write of it runs in a savepoint.
        - The kind refused and why; else True, or False when no such row could be written
          (nothing is known then).

        All rolled back; remembered for this transaction. Raises only when the session is lost.
        """
        wanted = [kind for kind in kinds if kind not in self._tests]
        if wanted:
            self._tests.update(self._test_table(wanted))
        tests = [self._tests[kind] for kind in kinds]
        failed = [test for test in tests if isinstance(test, writes.ProbeFailure)]
        return failed[0] if failed else all(tests)

    def _test_table(self, kinds: Sequence[str]) -> dict[str, writes.ProbeFailure | bool]:
        with self._conn.transaction(force_rollback=True):
            wait_ms = min(self._lock_wait_ms, writes.PROBE_LOCK_WAIT_MS)
            self._conn.execute(sql.query("limit_lock_wait", self._names), {"ms": str(wait_ms)})
            locked = self._locked_for_writes(kinds)
            if locked is not None:
                detail = f"the table is locked against writes: {locked}"
                failure = writes.ProbeFailure(kind=kinds[0], detail=detail, target=writes.ANY_ROW)
                return dict.fromkeys(kinds, failure)
            job_id = self._own_row()
            if job_id is None:
                return dict.fromkeys(kinds, False)
            seen = self._conn.execute(sql.query("probe_row_id", self._names), {"job_id": job_id}).fetchone()
            if seen is None:
                failure = writes.ProbeFailure(
                    kind=writes.SELECT,
                    detail="its SELECT does not see it: a row-level security policy hides rows "
                    "from this role",
                    target=writes.OWN_ROW,
                )
                return dict.fromkeys(kinds, failure)
            now = datetime.datetime.now(datetime.UTC)
            job = models.StagedJob(
                int(seen[0]), job_id, writes.PROBE_JOB_NAME, [], {}, "default", "default", {}, now
            )
            tests: dict[str, writes.ProbeFailure | bool] = {}
            for kind in kinds:
                why = self._try(*self._statement(kind, [job]))
                refused = writes.ProbeFailure(kind=kind, detail=why or "", target=writes.OWN_ROW)
                tests[kind] = True if why is None else refused
            return tests

    def _locked_for_writes(self, kinds: Sequence[str]) -> str | None:
        """Why the lock a settlement write takes was not granted within the lock wait, or None.
        Another error (a missing table, say) is left for the writes to meet."""
        try:
            with self._conn.transaction():
                self._conn.execute(sql.query("lock_for_writes", self._names))
                if writes.BURY in kinds:
                    self._conn.execute(sql.query("lock_dead_for_writes", self._names))
        except psycopg.Error as exc:
            if self._conn.broken:
                raise
            if isinstance(exc, psycopg.errors.LockNotAvailable | psycopg.errors.QueryCanceled):
                return errors.first_line(exc)
        return None

    def _own_row(self) -> uuid.UUID | None:
        """Write a row of the drain's own (the caller rolls it back): its job_id. None if this
        role may not INSERT, or the table refuses the row."""
        allowed = self._conn.execute(sql.query("can_insert", self._names), {"table": self._names.qualified})
        if allowed.fetchone() != (True,):
            return None
        job_id = uuid.uuid4()
        params = {"id": -secrets.randbits(62) - 1, "job_name": writes.PROBE_JOB_NAME, "job_id": job_id}
        try:
            with self._conn.transaction():
                self._conn.execute(sql.query("probe_row", self._names), params)
        except psycopg.Error:
            if self._conn.broken:
                raise
            return None
        return job_id

    def probe(
        self, jobs: Sequence[models.StagedJob], kinds: Sequence[str] = writes.PROBE_KINDS
    ) -> writes.ProbeFailure | None:
        """Whether these rows take each kind of settlement, rolled back: the first kind no row
        takes, with why.

        - Each kind is written for all the rows in a savepoint, deferred constraints fired.
        - A kind refused for them all is written for each row alone, until one takes it.
        - None when each kind is taken by at least one row, or there are no rows. A row refused
          alone is that row's matter: it is parked.
        - Whatever the error: the rows say whether a row is refused alone, not its SQLSTATE.

        Changes nothing; the transaction stays usable. Raises only when the session is lost.
        """
        if not jobs:
            return None
        for kind in kinds:
            statement, items = self._statement(kind, jobs)
            why = self._try(statement, items)
            if why is None or (
                len(items) > 1 and any(self._try(statement, [item]) is None for item in items)
            ):
                continue
            target = "due rows" if len(items) == 1 else f"each of {len(items)} due rows"
            return writes.ProbeFailure(kind=kind, detail=why, target=target)
        return None

    def probe_due(
        self, limit: int, paused: Sequence[str], exclude: Sequence[int], kinds: Sequence[str]
    ) -> tuple[int, writes.ProbeFailure | None]:
        """``probe`` the first ``limit`` due rows but ``exclude`` (and those of ``paused``
        backends), in a savepoint rolled back (their locks too): how many, and what failed."""
        with self._conn.transaction(force_rollback=True):
            jobs = self.select_due(limit, paused, exclude)
            return len(jobs), self.probe(jobs, kinds)

    def _statement(
        self, kind: str, jobs: Sequence[models.StagedJob]
    ) -> tuple[Callable[[Sequence[Any]], writes.Done], list[Any]]:
        """The statement of a ``kind`` of settlement write, and its items for these rows."""
        if kind == writes.DELETE:
            return self._delete_statement, [(job.id, job.job_id) for job in jobs]
        if kind == writes.RETRY:
            error = writes.PROBE_ERROR
            retries = [
                writes.Retry(row_id=job.id, job_id=job.job_id, counted=0, error=error, delay_s=0.0)
                for job in jobs
            ]
            return self._retry_statement, retries
        return self._bury_statement, [
            writes.Dead(job=job, error=writes.PROBE_ERROR, attempts=job.attempts) for job in jobs
        ]

    def _try(self, statement: Callable[[Sequence[Any]], writes.Done], items: Sequence[Any]) -> str | None:
        """Write ``items`` and roll back: why the table refused them, or None (raises only when
        the session is lost)."""
        try:
            with self._conn.transaction(force_rollback=True):
                changed, _ = statement(items)
                self.fire_deferred()
                if changed < len(items):
                    raise writes.Skipped(writes.skipped(changed, len(items)))
        except (psycopg.Error, writes.Skipped) as exc:
            if self._conn.broken:
                raise
            return errors.first_line(exc)
        return None


def _lock_held(
    conn: psycopg.Connection[Any], names: sql.Names, key: int, *, relaxed: bool = False
) -> tuple[int, bool]:
    """queries.sql lock_held on ``conn``: its backend pid, and whether it holds the lock ``key``."""
    classid, objid = connection.split_key(key)
    params = {"classid": classid, "objid": objid, "relaxed": relaxed}
    row = conn.execute(sql.query("lock_held", names), params).fetchone()
    assert row is not None
    return int(row[0]), bool(row[1])


def _walk_unless_a_row_changed(reader: reading.Reader, exc: psycopg.Error) -> None:
    """After a select through the lanes index failed on a session still up: unless a row changed
    since the snapshot (any select meets that), SelectAgain says to select again at once, as after
    one, and the member walks the due index, which takes the same rows: after a timeout or a
    deadlock until it looks for the index again, after an error of the function's own (dropped,
    not this role's to run, ...) until the function changes (drain.relay.lanes)."""
    if isinstance(exc, psycopg.errors.SerializationFailure):
        return
    reader.lanes_indexed = False
    reader.lanes_failed = not isinstance(exc, psycopg.OperationalError)
    log.warning(
        "the lanes select failed (%s, SQLSTATE %s): walking the due index until %s",
        type(exc).__name__,
        exc.sqlstate,
        "the lanes function is replaced (drain migrate)" if reader.lanes_failed else "the next look",
        extra={"event": "lanes_select_failed", "sqlstate": exc.sqlstate},
    )
    raise errors.SelectAgain(f"the select through the lanes index failed ({type(exc).__name__})") from exc


def _reads_in_order(plan: Mapping[str, Any]) -> bool:
    """Whether an EXPLAIN (FORMAT JSON) plan reads an index and sorts nothing (migrations.sql
    lanes_plan: an index gives each lane's rows in id order, the lanes index or a twin of it)."""
    nodes, found = [plan], False
    while nodes:
        node = nodes.pop()
        if "Sort" in str(node.get("Node Type", "")):
            return False
        found = found or "Index Name" in node
        nodes.extend(node.get("Plans", []))
    return found


def _fence(pid: int, current_pid: int, held: bool, what: str) -> None:
    """A batch's fence: PoolerDetected unless the session is still backend ``pid``, LeadershipLost
    unless it still holds ``what``."""
    if current_pid != pid:
        raise errors.PoolerDetected(
            f"the database session changed from backend {pid} to {current_pid}: "
            "a transaction-pooling proxy (PgBouncer pool_mode=transaction?) is in the way; "
            "connect the drain directly or through a session-mode pool"
        )
    if not held:
        raise errors.LeadershipLost(f"backend {pid} no longer holds {what}")


def _key_params(keys: Sequence[writes.Key]) -> dict[str, str]:
    """The rows (id, job_id) a settlement statement names, as its two arrays."""
    return {"ids": _array_text(key[0] for key in keys), "job_ids": _array_text(key[1] for key in keys)}


def _array_text(values: Iterable[object]) -> str:
    """Ids or job ids as an array's text, which the statement casts (``::bigint[]``, ``::uuid[]``).
    psycopg's list dumper costs microseconds an element; a pipelined step leaves out up to
    ``pipeline_depth`` batches of ids at every select."""
    return "{" + ",".join(map(str, values)) + "}"


class Ticks:
    """The statements of a schedule's pass (drain.relay.schedules), on the batch transaction's
    connection: the leader's fenced transaction."""

    def __init__(self, conn: psycopg.Connection[Any], names: sql.Names) -> None:
        self._conn = conn
        self._names = names

    def now(self) -> datetime.datetime:
        """The database clock, the one every schedule is evaluated against (never the drain's)."""
        row = self._conn.execute(sql.query("schedule_now", self._names)).fetchone()
        assert row is not None and isinstance(row[0], datetime.datetime)
        return row[0]

    def last_ticks(self, schedules: Sequence[str]) -> dict[str, datetime.datetime | None]:
        """The last tick of each of these schedules that has a row, by name; their rows locked."""
        with self._conn.cursor(row_factory=rows.dict_row) as cursor:
            cursor.execute(sql.query("schedule_ticks", self._names), {"names": list(schedules)})
            return {row["name"]: row["last_tick"] for row in cursor.fetchall()}

    def stage(self, jobs: Sequence[Mapping[str, Any]]) -> set[str]:
        """INSERT the jobs (tick_job's rows); return the job ids inserted (not those a row holds)."""
        return self._job_ids("schedule_stage", jobs)

    def same_ticks(self, held: Sequence[Mapping[str, Any]]) -> set[str]:
        """Of these jobs, whose job id a staged row holds, those whose row is that very tick."""
        return self._job_ids("schedule_tick_rows", held)

    def advance(self, advance: Mapping[str, Any]) -> bool:
        """Record a schedule's new last tick if it still is ``previous``; False when another
        session moved it."""
        return self._conn.execute(sql.query("schedule_advance", self._names), advance).fetchone() is not None

    def _job_ids(self, query: str, jobs: Sequence[Mapping[str, Any]]) -> set[str]:
        if not jobs:
            return set()
        result = self._conn.execute(sql.query(query, self._names), {"jobs": json.dumps(list(jobs))})
        return {str(row[0]) for row in result.fetchall()}
