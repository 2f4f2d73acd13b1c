"""The tests' own tables beside ``staged_jobs``, and the counts every end-to-end test asserts.

- ``ledger``: one row per job staged in a transaction, written in that same transaction (by
  tests.support.load), with the job's backend and the database clock of the transaction's *last
  statement before COMMIT* (``pre_commit_at``). A job whose transaction rolled back has no row.
- ``committed``: written by the staging thread *after* its COMMIT returned: the transaction's
  largest staged row id and the clock right after the commit (for commit-order checks).
- ``deliveries``: one row per run of a job by a worker (see tests.support.tasks).

:func:`tally` counts the ledger against the deliveries, or against what a broker holds.
"""

from __future__ import annotations

import collections
import dataclasses
import uuid
from collections.abc import Iterable

import psycopg

from tests.support.waiting import wait_until

SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    job_id        uuid PRIMARY KEY,
    txn           text NOT NULL DEFAULT '',
    backend       text NOT NULL DEFAULT 'default',
    pre_commit_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS committed (
    txn          text PRIMARY KEY,
    max_row_id   bigint NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS deliveries (
    job_id       uuid NOT NULL,
    job_name     text NOT NULL,
    args         jsonb NOT NULL,
    kwargs       jsonb NOT NULL,
    worker       int NOT NULL,
    delivered_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


def install(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)


@dataclasses.dataclass
class Tally:
    """The one count every end-to-end test asserts: the committed set against every delivery.

    ``delivered`` counts each delivery of a job id, so duplicates show; ``lost`` = committed −
    delivered − dead must be empty; ``phantom`` (delivered, never committed) must be empty.
    Built by :func:`tally`, from worker runs or from what the broker holds.
    """

    committed: set[uuid.UUID]
    delivered: collections.Counter[uuid.UUID]
    dead: set[uuid.UUID] = dataclasses.field(default_factory=set)
    rolled_back: set[uuid.UUID] = dataclasses.field(default_factory=set)
    remaining: int = 0
    """Rows still staged."""
    early: int = 0
    """Jobs that ran before their transaction's last statement (worker runs only)."""

    @property
    def lost(self) -> set[uuid.UUID]:
        return self.committed - self.delivered.keys() - self.dead

    @property
    def phantom(self) -> set[uuid.UUID]:
        """Delivered but never committed (G2/G3 violations)."""
        return set(self.delivered) - self.committed

    @property
    def duplicates(self) -> int:
        """Deliveries beyond the first of each job."""
        return sum(count - 1 for count in self.delivered.values())

    @property
    def max_runs(self) -> int:
        return max(self.delivered.values(), default=0)

    def __str__(self) -> str:
        return (
            f"committed {len(self.committed)} delivered {len(self.delivered)} dead {len(self.dead)} "
            f"lost {len(self.lost)} duplicates {self.duplicates} (max runs of one job {self.max_runs}) "
            f"phantom {len(self.phantom)} early {self.early} rolled-back {len(self.rolled_back)} "
            f"remaining {self.remaining}"
        )

    def check(self) -> None:
        """Nothing lost, nothing delivered that did not commit, nothing run before its commit."""
        assert not self.lost, f"lost {len(self.lost)} committed jobs: {self}"
        assert not self.phantom, f"delivered jobs that never committed: {self}"
        assert not (self.delivered.keys() & self.rolled_back), f"a rolled-back job was delivered: {self}"
        assert self.early == 0, f"jobs ran before their transaction committed: {self}"


EARLY = """
SELECT count(*) FROM (SELECT job_id, min(delivered_at) AS first FROM deliveries GROUP BY job_id) AS r
JOIN ledger l USING (job_id) WHERE r.first < l.pre_commit_at
"""


def tally(
    dsn: str,
    delivered: collections.Counter[uuid.UUID] | None = None,
    rolled_back: Iterable[uuid.UUID] = (),
) -> Tally:
    """The ledger (committed in the staging transactions) against ``delivered``: by default the
    runs workers recorded (``deliveries``), else what the test counted on the broker."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        committed = {row[0] for row in conn.execute("SELECT job_id FROM ledger")}
        if delivered is None:
            delivered = collections.Counter(row[0] for row in conn.execute("SELECT job_id FROM deliveries"))
        dead = {row[0] for row in conn.execute("SELECT job_id FROM staged_jobs_dead")}
        remaining = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
        early = conn.execute(EARLY).fetchone()
    return Tally(
        committed,
        delivered,
        dead,
        set(rolled_back),
        remaining=remaining[0] if remaining else -1,
        early=early[0] if early else -1,
    )


def remaining(dsn: str) -> int:
    """Rows still staged."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    return int(row[0]) if row else -1


def wait_drained(dsn: str, expected: int | None = None, timeout_s: float = 120.0) -> Tally | None:
    """Wait until the staged-jobs table is empty. Given the ``expected`` number of committed jobs,
    also until every one of them ran at least once (worker runs), and return that tally."""
    if expected is None:
        wait_until("the staged-jobs table to drain", lambda: remaining(dsn) == 0, timeout_s)
        return None
    last: list[Tally] = []

    def done() -> bool:
        current = tally(dsn)
        last[:] = [current]
        return len(current.committed) == expected and not current.lost and current.remaining == 0

    try:
        wait_until(f"{expected} committed jobs to be delivered", done, timeout_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last[0] if last else '?'}") from None
    return last[0]
