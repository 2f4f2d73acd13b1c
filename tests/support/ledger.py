"""The tests' own tables beside ``staged_jobs``, and the counts every end-to-end test asserts.

- ``ledger``: one row per job staged in a transaction, written in that same transaction, with
  the database clock of the transaction's *last statement before COMMIT* (``pre_commit_at``).
  A job whose transaction rolled back has no ledger row.
- ``committed``: written by the staging thread *after* its COMMIT returned: the transaction's
  largest staged row id and the clock right after the commit (for commit-order checks).
- ``deliveries``: one row per run of a job by an RQ worker (see tests.support.tasks).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import psycopg

SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    job_id        uuid PRIMARY KEY,
    txn           text NOT NULL,
    pre_commit_at timestamptz NOT NULL
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
    """Committed versus delivered, from the database."""

    committed: int
    delivered_distinct: int
    deliveries: int
    lost: int
    unexpected: int
    duplicates: int
    early: int
    staged_left: int
    max_runs: int

    def __str__(self) -> str:
        return (
            f"committed={self.committed} delivered={self.delivered_distinct} lost={self.lost} "
            f"unexpected={self.unexpected} duplicate_runs={self.duplicates} (max runs of one job "
            f"{self.max_runs}) early={self.early} staged_left={self.staged_left}"
        )


TALLY = """
WITH runs AS (SELECT job_id, count(*) AS n, min(delivered_at) AS first FROM deliveries GROUP BY job_id)
SELECT
    (SELECT count(*) FROM ledger) AS committed,
    (SELECT count(*) FROM runs) AS delivered_distinct,
    (SELECT count(*) FROM deliveries) AS deliveries,
    (SELECT count(*) FROM ledger l WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.job_id = l.job_id)) AS lost,
    (SELECT count(*) FROM runs r WHERE NOT EXISTS (SELECT 1 FROM ledger l WHERE l.job_id = r.job_id))
        AS unexpected,
    (SELECT coalesce(sum(n - 1), 0) FROM runs) AS duplicates,
    (SELECT count(*) FROM runs r JOIN ledger l USING (job_id) WHERE r.first < l.pre_commit_at) AS early,
    (SELECT count(*) FROM staged_jobs) AS staged_left,
    (SELECT coalesce(max(n), 0) FROM runs) AS max_runs
"""


def tally(dsn: str) -> Tally:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(TALLY).fetchone()
    assert row is not None
    return Tally(*(int(value) for value in row))


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something truthy and return that; fail with ``what``
    at the deadline. The one polling helper of the test suite."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def steps_until(
    step: Callable[[], Any], done: Callable[[Any], bool], what: str, max_steps: int = 1000
) -> None:
    """Call ``step`` until ``done(its result)``; fail with ``what`` after ``max_steps`` calls."""
    for _ in range(max_steps):
        if done(step()):
            return
    raise AssertionError(f"{what}: not done after {max_steps} steps")


def wait_drained(dsn: str, expected: int, timeout_s: float = 120.0) -> Tally:
    """Wait until every committed job ran at least once and the staged table is empty."""
    last: list[Tally] = []

    def done() -> bool:
        current = tally(dsn)
        last[:] = [current]
        return current.committed == expected and current.lost == 0 and current.staged_left == 0

    try:
        wait_until(done, timeout_s, f"{expected} committed jobs to be delivered")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last[0] if last else '?'}") from None
    return last[0]
