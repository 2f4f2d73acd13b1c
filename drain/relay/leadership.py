"""Leader election with a Postgres session-level advisory lock, and how a lost leader is fenced.

::

        start ──► FOLLOWER ──try_acquire() wins──► LEADER ──release() / session lost──► FOLLOWER
                    │  ▲                             │
                    └──┘ lost: wait standby_retry_s  └─ verify() in every batch transaction
                         (with jitter), try again

Only one session can hold the lock, and it is held by the *session*: if the leader's process
dies, or its connection is cut, Postgres ends the backend (at once on a clean close; within the
keepalive / tcp_user_timeout budget on a silent death; after idle_in_transaction_session_timeout
for a leader frozen mid-batch, after idle_session_timeout for one frozen between batches:
drain.store.session) and the lock is free for a standby.

Fencing: reads, deletes and the lock share one session, so a leader that lost its session cannot
delete anything: the delete would have to commit on a session that no longer exists. Each batch
starts by checking, inside its transaction, that ``pg_backend_pid()`` is the backend that took the
lock and that it still holds it; a transaction-pooling proxy fails this check, and the drain
refuses to lead behind one. A lone client of a transaction pool may get the same backend back
for every statement, so on winning the lock a second, fresh session also checks that it is
*not* that backend (a pool reuses the idle backend we just left; a direct or session-pooled
connection never can). What cannot be fenced is a publish already under way when the
session was lost: the next leader publishes those rows again (a duplicate, never a loss), which
is why every job carries a stable job id.

Standbys poll with ``pg_try_advisory_lock`` rather than block in ``pg_advisory_lock``: a blocked
waiter whose client died could be granted the lock and then hold it, unseen, until keepalives fire.
The lock is taken once per term (session locks stack) and released with one unlock.

Settle or do not publish (drain.relay.settling): advisory locks are per server, so a drain connected to
a standby, or through a read-only session, could take "the" lock while the real leader holds it
on the primary. Before trying the lock, a standby checks that its session can settle there (not
in recovery, not read-only, the privileges a settlement needs); if not, it does not try, and says
why (``blocker``). On a standby server or a read-only session it also closes the session, so the
next try connects again through every host of a multi-host DSN (``target_session_attrs``). Having
won the lock, it tests the table, rolled back (the probe, drain.store.session.Store.probe_settlement): the
lock every settlement write takes, then a row of its own that its SELECT must see and that must
take the DELETE, the retry UPDATE and the burial (a trigger, a rule, a row-level security policy,
a deferred constraint, the dead-letter table refusing or skipping it). Without INSERT on the table
it writes each kind for the due rows its first batch would take instead, each alone until one
takes it. If the table refuses a kind, it unlocks and stands by, saying which write failed. A row
refused alone is that row's matter: its settlement will be refused, and it is parked.
"""

from __future__ import annotations

import hashlib
import logging
import time

import psycopg

from drain import errors
from drain.relay import settling
from drain.store import identity
from drain.store import session as store

POOLER_ROUNDS = 3
"""How many times taking the lock checks that the session kept its backend (see try_acquire)."""

log = logging.getLogger(__name__)


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
        self.blocker: settling.Blocker | None = None
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
        found = settling.blockers(check)
        self.blocker = found[0] if found else None
        self.row_security = settling.row_security(check)
        if self.blocker is not None:
            if self.blocker.reason in (settling.RECOVERY, settling.READ_ONLY):
                self._store.close()  # the next try connects again, to whichever host is primary now
            return False
        acquired, pid = self._store.try_lock(self.key)
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
            self._store.unlock(self.key)
            return False
        self._store.name_session(identity.application_name(leading_since=time.time()))
        self.pid = pid
        return True

    def _probe(self) -> bool:
        """Test whether the table takes every kind of settlement, rolled back
        (Store.probe_settlement); False, with ``blocker`` set (which write, and why), if it
        refuses one while the session stays up. A missing table is the relay's to report."""
        try:
            failure = self._store.probe_settlement(self._store.settings.batch_size)
        except psycopg.errors.UndefinedTable:
            return True
        except psycopg.Error as exc:
            if not self._store.alive:
                raise
            self.blocker = settling.probe_fails(store.SELECT, errors.first_line(exc))
            return False
        if failure is not None:
            self.blocker = settling.probe_fails(*failure)
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
            self._store.unlock(self.key)
            self._store.name_session(identity.application_name())
        except Exception as exc:  # noqa: BLE001 - the session ending releases the lock anyway
            log.debug("unlock failed (%s); closing the session releases the lock", type(exc).__name__)
