"""drain_commit_to_publish_seconds measures from the commit as well as the database can tell
(issue 14): from the staging transaction's commit on a server with track_commit_timestamp = on,
else from its start (created_at). A private cluster, since the setting needs a restart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest

import drain
from drain import config
from drain.store import session as store
from tests.support import postgres

OPEN_S = 1.0  # the staging transaction stays open this long after its INSERT


@pytest.fixture(scope="module")
def commit_times_on() -> Iterator[str]:
    if not postgres.available():
        pytest.skip("no PostgreSQL server binaries for a private cluster")
    cluster = postgres.PrivatePostgres()
    try:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET track_commit_timestamp = on")
        cluster.crash()
        cluster.start()
        yield cluster.migrated_database("drain_commit_ts")
    finally:
        cluster.stop()


def age_of_a_job_held_open(dsn: str) -> float:
    with psycopg.connect(dsn) as conn:
        drain.stage(conn, "app.t")
        time.sleep(OPEN_S)  # the transaction's start and its commit are OPEN_S apart
    db = store.Store(config.Settings(dsn=dsn))
    try:
        with db.batch() as batch:
            (job,) = batch.select_due(10)
        return job.age_s
    finally:
        db.close()


def test_measured_from_the_commit_when_the_server_records_it(commit_times_on: str) -> None:
    with psycopg.connect(commit_times_on) as conn:
        assert conn.execute("SHOW track_commit_timestamp").fetchone() == ("on",)
    assert age_of_a_job_held_open(commit_times_on) < OPEN_S


def test_measured_from_the_transactions_start_otherwise(database: str) -> None:
    with psycopg.connect(database) as conn:
        if conn.execute("SHOW track_commit_timestamp").fetchone() == ("on",):
            pytest.skip("the shared server records commit times")
    assert age_of_a_job_held_open(database) >= OPEN_S
