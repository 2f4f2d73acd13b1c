"""Leader election with a Postgres session-level advisory lock, and how a lost leader is fenced.

::

        start ──► FOLLOWER ──try_acquire() wins──► LEADER ──release() / session lost──► FOLLOWER
                    │  ▲                             │
                    └──┘ lost: wait standby_retry_s  └─ verify() in every batch transaction
                         (with jitter), try again

Only one session can hold the lock, and it is held by the *session*: if the leader's process
dies, or its connection is cut, Postgres ends the backend (at once on a clean close; within the
keepalive / tcp_user_timeout budget on a silent death; after idle_in_transaction_session_timeout
for a leader frozen mid-batch) and the lock is free for a standby.

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
"""

from __future__ import annotations

import hashlib
import logging

from drain import errors, store

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

    @property
    def is_leader(self) -> bool:
        return self.pid is not None

    def try_acquire(self) -> bool:
        """Try once; on success remember the backend that holds the lock and return True.

        Raises PoolerDetected when the lock lands on another backend than the next statement.
        """
        if self.pid is not None:
            return True
        acquired, pid = self._store.try_lock(self.key)
        if not acquired:
            return False
        held, current = self._store.lock_held(self.key)
        if held and current == pid:
            # A lone client of a transaction pool gets the same backend back every time; a
            # second session exposes it (see Store.lock_held_elsewhere).
            held_there, probe_pid = self._store.lock_held_elsewhere(self.key)
            held = not held_there and probe_pid != pid
        if not held or current != pid:
            self._store.close()
            raise errors.PoolerDetected(
                "the advisory lock was taken on one database backend and the next statement ran "
                "on another: a transaction-pooling proxy (PgBouncer pool_mode=transaction?) is in "
                "the way; connect the drain directly or through a session-mode pool"
            )
        self.pid = pid
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
        except Exception as exc:  # noqa: BLE001 - the session ending releases the lock anyway
            log.debug("unlock failed (%s); closing the session releases the lock", type(exc).__name__)
