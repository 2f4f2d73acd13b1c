"""Whether the table takes a settlement's writes, asked with writes rolled back.

Before it leads, and when a whole part of a settlement is refused, the drain asks the table
itself (:meth:`Probe.test_table`): a row of the drain's own, written, read and settled each
way in savepoints, all rolled back. Without one (no INSERT privilege), it asks the due rows
(:meth:`Probe.probe`). Either way nothing changes and the transaction stays usable.
"""

from __future__ import annotations

import datetime
import secrets
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import rows
from psycopg import sql as pgsql

from drain import errors, models
from drain.store import migrations, sql, writes

SETTLE_TABLE_PRIVILEGES = ("SELECT", "UPDATE", "DELETE")
SETTLE_DEAD_PRIVILEGES = ("SELECT", "INSERT")
SETTLE_VERSIONS_PRIVILEGES = ("SELECT",)


def settle_check(
    conn: psycopg.Connection[Any], names: sql.Names, schema_version: Callable[[], int]
) -> dict[str, Any]:
    """in_recovery, read_only, role, the privileges a settlement needs that the role lacks
    (table_missing, dead_missing, versions_missing: lists of privilege names), the three
    tables' quoted names (table, dead, versions), the table's schema_version (None when the
    role may not read it) and the latest_version this drain writes for. See
    ``settle_check`` in queries.sql."""
    dead = pgsql.Identifier(names.schema, names.dead).as_string(conn)
    versions = pgsql.Identifier(names.schema, names.versions).as_string(conn)
    with conn.cursor(row_factory=rows.dict_row) as cursor:
        cursor.execute(
            sql.query("settle_check", names),
            {
                "table": names.qualified,
                "dead": dead,
                "versions": versions,
                "table_privileges": list(SETTLE_TABLE_PRIVILEGES),
                "dead_privileges": list(SETTLE_DEAD_PRIVILEGES),
                "versions_privileges": list(SETTLE_VERSIONS_PRIVILEGES),
            },
        )
        row = cursor.fetchone()
    assert row is not None
    version = None if row["versions_missing"] else schema_version()
    return {
        **row,
        "table": names.qualified,
        "dead": dead,
        "versions": versions,
        "schema_version": version,
        "latest_version": migrations.LATEST_VERSION,
    }


class Probe:
    """The table's tests in one transaction, remembered for it (drain.store.session.Batch)."""

    def __init__(self, conn: psycopg.Connection[Any], names: sql.Names, writes_: writes.Writes) -> None:
        self._conn = conn
        self._names = names
        self._writes = writes_
        self.tests: dict[str, writes.TableTest] = {}  # test_table's findings, by kind
        self.lock_wait_ms = writes.PROBE_LOCK_WAIT_MS  # Batch.limit_lock_wait's (tests wait no longer)

    def test_table(self, kinds: Sequence[str] = writes.PROBE_KINDS) -> writes.TableTest:
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
        wanted = [kind for kind in kinds if kind not in self.tests]
        if wanted:
            self.tests.update(self._test_table(wanted))
        tests = [self.tests[kind] for kind in kinds]
        failed = [test for test in tests if test.failure is not None]
        if failed:
            return failed[0]
        return writes.TableTest(all(test.tested for test in tests))

    def _test_table(self, kinds: Sequence[str]) -> dict[str, writes.TableTest]:
        with self._conn.transaction(force_rollback=True):
            wait_ms = min(self.lock_wait_ms, writes.PROBE_LOCK_WAIT_MS)
            self._conn.execute(sql.query("limit_lock_wait", self._names), {"ms": str(wait_ms)})
            locked = self._locked(kinds)
            if locked is not None:
                failure = writes.ProbeFailure(
                    kinds[0], f"the table is locked against writes: {locked}", writes.ANY_ROW
                )
                return dict.fromkeys(kinds, writes.TableTest(True, failure))
            job_id = self._own_row()
            if job_id is None:
                return dict.fromkeys(kinds, writes.TableTest(False))
            seen = self._conn.execute(sql.query("probe_row_id", self._names), {"job_id": job_id}).fetchone()
            if seen is None:
                failure = writes.ProbeFailure(
                    writes.SELECT,
                    "its SELECT does not see it: a row-level security policy hides rows from this role",
                    writes.OWN_ROW,
                )
                return dict.fromkeys(kinds, writes.TableTest(True, failure))
            now = datetime.datetime.now(datetime.UTC)
            job = models.StagedJob(
                int(seen[0]), job_id, writes.PROBE_JOB_NAME, [], {}, "default", "default", {}, now
            )
            tests = {}
            for kind in kinds:
                why = self._try(*self._statement(kind, [job]))
                tests[kind] = writes.TableTest(
                    True, None if why is None else writes.ProbeFailure(kind, why, writes.OWN_ROW)
                )
            return tests

    def _locked(self, kinds: Sequence[str]) -> str | None:
        """Why the lock a settlement write takes was not granted within the lock wait, or None
        (another error, a missing table say, is left for the writes to meet)."""
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
        """Write a row of the drain's own (the caller rolls it back): its job_id; None if this
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
            statement, items = self._statement(kind, jobs)
            why = self._try(statement, items)
            if why is None or (
                len(items) > 1 and any(self._try(statement, [item]) is None for item in items)
            ):
                continue
            return writes.ProbeFailure(
                kind, why, "due rows" if len(items) == 1 else f"each of {len(items)} due rows"
            )
        return None

    def _statement(
        self, kind: str, jobs: Sequence[models.StagedJob]
    ) -> tuple[Callable[[Sequence[Any]], writes.Done], list[Any]]:
        """The statement of a ``kind`` of settlement write, and its items for these rows."""
        if kind == writes.DELETE:
            return self._writes.delete, [(job.id, job.job_id) for job in jobs]
        if kind == writes.RETRY:
            return self._writes.record_failures, [
                writes.Retry(job.id, job.job_id, 0, writes.PROBE_ERROR, 0.0) for job in jobs
            ]
        return self._writes.bury, [writes.Dead(job, writes.PROBE_ERROR, job.attempts) for job in jobs]

    def _try(self, statement: Callable[[Sequence[Any]], writes.Done], items: Sequence[Any]) -> str | None:
        """Write ``items`` and roll back: why the table refused them, or None. Raises only when
        the session is lost."""
        try:
            with self._conn.transaction(force_rollback=True):
                changed, _ = statement(items)
                self._writes.fire_deferred()
                if changed < len(items):
                    raise writes.Skipped(writes.skipped(changed, len(items)))
        except (psycopg.Error, writes.Skipped) as exc:
            if self._conn.broken:
                raise
            return errors.first_line(exc)
        return None
