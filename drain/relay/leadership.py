"""Leader election with a Postgres session-level advisory lock, and how a lost leader is fenced.

The states it moves the loop between: drain.relay.loop (its drawing).

The lock:
    - Only one session can hold it. If the leader's process dies or its connection is cut,
      Postgres ends the backend and frees the lock: at once on a clean close, within the
      keepalive and tcp_user_timeout budget on a silent death.
    - A leader frozen mid-batch is ended by idle_in_transaction_session_timeout, one frozen
      between batches by idle_session_timeout (drain.store.session).
    - It is taken once per term (session locks stack) and released with one unlock.

Why standbys poll:
    They call ``pg_try_advisory_lock`` rather than block in ``pg_advisory_lock``. A blocked
    waiter whose client died could be granted the lock. It would then hold it, unseen, until
    keepalives fire.

Fencing:
    - Reads, deletes and the lock share one session. A leader that lost its session cannot
      delete anything: the delete would have to commit on a session that no longer exists.
    - Each batch starts by checking, inside its transaction, that ``pg_backend_pid()`` is the
      backend that took the lock, and that it still holds it.
    - A transaction-pooling proxy fails this check, and the drain refuses to lead behind one.
    - A lone client of a transaction pool may get the same backend back for every statement.
      So on winning the lock, a second, fresh session checks that it is *not* that backend. A
      pool reuses the idle backend we just left; a direct or session-pooled connection never
      can.
    - A publish already under way when the session was lost cannot be fenced. The next leader
      publishes those rows again: a duplicate, never a loss. That is why every job carries a
      stable job id.

Settle or do not publish (Blocker):
    Advisory locks are per server. A drain on a standby, or on a read-only session, could take
    "the" lock while the real leader holds it on the primary. So::

        try the lead ──► settle_check: in recovery? read-only? an older schema? privileges?
                              │ none                                   ──any──► stand by, say why
                              ▼
                         take the lock; the probe: test the table, rolled back
                         ──a kind of write refused──► release the lock, stand by, say which and why
                              │ each kind taken
                              ▼
                         publish, settle ──a part refused──► drain.relay.settle: park or hold the
                                                             row, or fail the whole settlement

    - Why it stands by is ``blocker``. On a standby or a read-only session it also closes the
      session: the next try connects through every host of a multi-host DSN.
    - The probe is drain.store.session.Store.probe_settlement.
    - Whether the *table* refuses is never decided from one row's error, its SQLSTATE least of
      all. Only a write the table refuses whichever row it names (the drain's own row, its lock)
      tells.
    - How long it may stand by: drain.relay.settle (Cannot settle). On an older schema the
      drain must not lead: its settlements are written for the current one.
    - Under a persistent settlement failure each row is published at most twice: once before the
      failure was known, once more after it is healed if the process exited meanwhile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import psycopg

from drain import errors
from drain.store import identity, writes
from drain.store import session as store

POOLER_ROUNDS = 3
"""How many times taking the lock checks that the session kept its backend (see try_acquire)."""

log = logging.getLogger(__name__)

RECOVERY = "recovery"
READ_ONLY = "read_only"
SCHEMA = "schema"
PRIVILEGES = "privileges"
SELECT_FAILS = "select_fails"
DELETE_FAILS = "delete_fails"
RETRY_FAILS = "retry_fails"
BURY_FAILS = "bury_fails"
SETTLEMENT_FAILED = "settlement_failed"
LANES = "lanes"  # another drain of the table runs with another lane count (drain.relay.lanes)
REASONS = (
    RECOVERY,
    READ_ONLY,
    SCHEMA,
    PRIVILEGES,
    SELECT_FAILS,
    DELETE_FAILS,
    RETRY_FAILS,
    BURY_FAILS,
    SETTLEMENT_FAILED,
    LANES,
)
"""Every reason, the values of the ``reason`` label of ``drain_cannot_settle``."""
_PROBED = {  # the probe's kind of write (drain.store.writes.PROBE_KINDS, SELECT): its reason, what it tried
    kind: (reason, writes.TRIED[kind])
    for kind, reason in (
        (writes.SELECT, SELECT_FAILS),
        (writes.DELETE, DELETE_FAILS),
        (writes.RETRY, RETRY_FAILS),
        (writes.BURY, BURY_FAILS),
    )
}


@dataclasses.dataclass(frozen=True)
class Blocker:
    """Why this drain cannot settle where it is connected: ``reason`` (one of REASONS, a metric
    label) and ``detail`` (one line for logs, ``drain status`` and ``drain check``)."""

    reason: str
    detail: str

    @property
    def unbounded(self) -> bool:
        """A standby server (waiting for a failover), an older schema (waiting for `drain
        migrate`) or drains of another lane count (waiting for the last of them to stop):
        standing by for it is normal and has no time bound."""
        return self.reason in (RECOVERY, SCHEMA, LANES)


def blockers(check: Mapping[str, Any]) -> list[Blocker]:
    """What a ``Store.settle_check`` row says stands in the way, most fundamental first."""
    found: list[Blocker] = []
    if check["in_recovery"]:
        found.append(
            Blocker(RECOVERY, "the server is a standby (in recovery): a drain leads only on the primary")
        )
    elif check["read_only"]:
        found.append(
            Blocker(
                READ_ONLY,
                "the session is read-only (transaction_read_only is on: default_transaction_read_only "
                "in the DSN, the role, the database or the server): it cannot delete what it publishes",
            )
        )
    version, latest = check.get("schema_version"), check.get("latest_version")
    if version is not None and latest is not None and 0 < version < latest and not check["in_recovery"]:
        found.append(Blocker(SCHEMA, older_schema(check["table"], version, latest)))
    missing = [
        f"{', '.join(check[f'{table}_missing'])} on {check[table]}"
        for table in ("table", "dead", "versions")
        if check.get(f"{table}_missing")
    ]
    if missing and not check["in_recovery"]:
        found.append(
            Blocker(PRIVILEGES, f"role {check['role']} lacks {'; '.join(missing)}: it cannot settle")
        )
    return found


def older_schema(table: str, version: int, latest: int) -> str:
    """The line that says a table is older than this drain."""
    return f"{table} is at schema version {version}, this drain expects {latest}: run `drain migrate`"


def row_security(check: Mapping[str, Any]) -> str | None:
    """What a ``Store.settle_check`` row says about row-level security, or None: policies that
    apply to the drain's role decide which rows it sees, and a row they hide is never forwarded,
    with no error anywhere. Not a Blocker (a policy may admit every row): ``drain check`` fails
    on it, ``drain status`` and the leader's log warn."""
    if not check.get("row_security"):
        return None
    return (
        f"row-level security applies to role {check['role']} on {check['table']}: a row its "
        "policies hide from the drain is never forwarded (give the role a policy USING (true), "
        "or BYPASSRLS; docs/operations/database.md, Row-level security)"
    )


def probe_fails(kind: str, detail: str, target: str = "due rows") -> Blocker:
    """The probe's ``kind`` of write (drain.store.writes.PROBE_KINDS, or the read of a row of its own)
    of its ``target`` was refused, for ``detail``."""
    reason, what = _PROBED[kind]
    return Blocker(reason, f"{what} of {target} (rolled back) failed: {detail}")


def lock_key(schema: str, table: str) -> int:
    """The advisory lock key for one table: a signed 64-bit hash of a namespaced name."""
    digest = hashlib.blake2b(f"drain:{schema}.{table}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class Leadership:
    """The lock for one staged-jobs table, taken on the Store's session."""

    def __init__(self, db: store.Store) -> None:
        self._store = db
        self.key = lock_key(db.settings.schema, db.settings.table)
        self.pid: int | None = None
        self.blocker: Blocker | None = None
        """Why the last try did not take the lock although it may be free (None: another holds it)."""
        self.row_security: str | None = None
        """What the last try's check said about row-level security for this role (a warning)."""

    @property
    def is_leader(self) -> bool:
        return self.pid is not None

    def try_acquire(self) -> bool:
        """Try once; on success remember the backend that holds the lock and return True.

        Returns False without trying when this session cannot settle here, and False after
        unlocking again when the probe fails (``blocker`` says why). Raises PoolerDetected when
        the lock lands on another backend than the next statement.
        """
        if self.pid is not None:
            return True
        check = self._store.settle_check()
        found = blockers(check)
        self.blocker = found[0] if found else None
        self.row_security = row_security(check)
        if self.blocker is not None:
            if self.blocker.reason in (RECOVERY, READ_ONLY):
                self._store.close()  # the next try connects again, to whichever host is primary now
            return False
        acquired, pid = self._take()
        if not acquired:
            return False
        held, current = True, pid
        for _ in range(POOLER_ROUNDS):
            held, current = self._store.lock_held(self.key)
            if not held or current != pid:
                break
            # A lone client of a transaction pool gets the same backend back every time; a
            # second session exposes it (see Store.lock_held_elsewhere). Shared with other
            # clients, the pool may hand either statement another backend: a few rounds make a
            # miss unlikely, and every batch is fenced by the same check (Batch.check_lock).
            held_there, probe_pid = self._store.lock_held_elsewhere(self.key)
            if held_there or probe_pid == pid:
                held = False
                break
        if not held or current != pid:
            self._store.close()
            raise errors.PoolerDetected(
                "the advisory lock was taken on one database backend and the next statement ran "
                "on another: a transaction-pooling proxy (PgBouncer pool_mode=transaction?) is in "
                "the way; connect the drain directly or through a session-mode pool"
            )
        if not self._probe():
            self._untake()
            return False
        self._store.name_session(identity.application_name(leading_since=time.time()))
        self.pid = pid
        return True

    def _take(self) -> tuple[bool, int]:
        """Try the lock once: (taken, this session's backend pid)."""
        return self._store.try_lock(self.key)

    def _untake(self) -> None:
        self._store.unlock(self.key)

    @property
    def leads_schedules(self) -> bool:
        """Whether this drain stages the schedules' ticks (drain.relay.schedules): the leader."""
        return self.pid is not None

    def balance(self, settle: Callable[[], bool]) -> None:
        """One lane, one leader: nothing to hand over (drain.relay.lanes.Lanes balances)."""

    def balance_in_s(self) -> float | None:
        """Seconds until the next balance (an idle wait ends for it); None: no balance."""
        return None

    def _probe(self) -> bool:
        """Test whether the table takes every kind of settlement, rolled back
        (Store.probe_settlement). False, with ``blocker`` set (which write, and why), if it
        refuses one while the session stays up. A missing table is the relay's to report."""
        try:
            failure = self._store.probe_settlement(self._store.settings.batch_size)
        except psycopg.errors.UndefinedTable:
            return True
        except psycopg.Error as exc:
            if not self._store.alive:
                raise
            self.blocker = probe_fails(writes.SELECT, errors.first_line(exc))
            return False
        if failure is not None:
            self.blocker = probe_fails(*failure)
            return False
        return True

    def verify(self, batch: store.Batch) -> None:
        """Fence one batch: raise LeadershipLost unless we still hold the lock on the same backend."""
        if self.pid is None:
            raise errors.LeadershipLost("not the leader")
        batch.check_lock(self.key, self.pid)

    def forget(self) -> None:
        """Drop the claim after the session was lost (the server already released the lock)."""
        self.pid = None

    def release(self) -> None:
        """Unlock if we hold the lock; errors are ignored since closing the session frees it too."""
        if self.pid is None:
            return
        self.pid = None
        try:
            self._untake()
            self._store.name_session(identity.application_name())
        except Exception as exc:  # noqa: BLE001 - the session ending releases the lock anyway
            log.debug("unlock failed (%s); closing the session releases the lock", type(exc).__name__)
