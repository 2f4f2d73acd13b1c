"""The pooler guard (G5, SPEC §5) against a real PgBouncer.

Behind ``pool_mode=transaction`` the session-level advisory lock stays on whatever server
connection ran it, so ``drain run`` must refuse to lead (exit 4, one line) — both when other
clients share the pool (the next statement lands on another backend) and when the drain is the
pool's only client (it may get the same backend back every time). Behind ``pool_mode=session``
the drain leads and forwards jobs normally.
"""

from __future__ import annotations

import sys
import threading
import urllib.parse
import uuid
from pathlib import Path

import psycopg
import pytest
import redis
import rq

import drain
from drain import cli, config
from drain.store import connection
from tests.support import pgbouncer

RUN_TIMEOUT_S = 120.0


def through(database: str, port: int) -> str:
    """The test's DSN, but to PgBouncer on ``port`` (whatever port the tests' Postgres has)."""
    parts = urllib.parse.urlsplit(database)
    return parts._replace(netloc=f"{parts.username}@127.0.0.1:{port}").geturl()


def drain_command() -> str:
    return str(Path(sys.executable).parent / "drain")


def run_drain(tmp_path: Path, dsn: str, backend_toml: str, *args: str) -> tuple[int, str]:
    import subprocess

    config_file = tmp_path / "drain.toml"
    config_file.write_text(f"standby_retry_s = 0.2\npoll_max_s = 0.2\n\n{backend_toml}")
    done = subprocess.run(
        [drain_command(), "run", *args, "--config", str(config_file), "--dsn", dsn],
        check=False,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env={"PATH": "/usr/bin:/bin"},
    )
    return done.returncode, done.stderr + done.stdout


class PoolLoad:
    """Another client of the same pool: one transaction held open, and a stream of short ones."""

    def __init__(self, dsn: str) -> None:
        self._held = psycopg.connect(dsn)
        self._held.execute("SELECT 1")  # BEGIN: pins one server connection for the whole test
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._churn, args=(dsn,), daemon=True)
        self._thread.start()

    def _churn(self, dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
            while not self._stop.is_set():
                conn.execute("SELECT pg_sleep(0.005)")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._held.close()


@pytest.mark.parametrize("with_load", [True, False], ids=["shared-pool", "lone-client"])
def test_transaction_pooling_is_refused(database: str, tmp_path: Path, with_load: bool) -> None:
    with psycopg.connect(database) as conn:
        drain.stage_many(conn, [drain.Job("app.t", args=[n]) for n in range(3)])
    with pgbouncer.pgbouncer(tmp_path, pool_mode="transaction", pool_size=4) as port:
        other = PoolLoad(through(database, port)) if with_load else None
        try:
            code, output = run_drain(
                tmp_path, through(database, port), '[backends.default]\ntype = "memory"\n'
            )
        finally:
            if other is not None:
                other.close()
    lines = output.strip().splitlines()
    assert code == cli.EXIT_REFUSED, output
    assert lines[-1].startswith("drain: refusing to lead: ") and "transaction-pooling" in lines[-1]
    assert "Traceback" not in output
    with psycopg.connect(database) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    assert row == (3,)  # nothing forwarded, nothing deleted


def test_session_pooling_leads_and_drains(database: str, tmp_path: Path, redis_db: str) -> None:
    queue = f"drain-pgbouncer-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database) as conn:
        job_ids = drain.stage_many(conn, [drain.Job("app.t", args=[n], queue=queue) for n in range(20)])
    backend_toml = f'[backends.default]\ntype = "rq"\nurl = "{redis_db}"\nallowed_jobs = ["app.t"]\n'
    with pgbouncer.pgbouncer(tmp_path, pool_mode="session", pool_size=4) as port:
        other = PoolLoad(through(database, port))
        try:
            code, output = run_drain(tmp_path, through(database, port), backend_toml, "--once")
        finally:
            other.close()
    assert code == cli.EXIT_OK, output
    assert "published 20" in output
    with psycopg.connect(database) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    assert row == (0,)
    client = redis.Redis.from_url(redis_db)
    try:
        assert sorted(rq.Queue(queue, connection=client).job_ids) == sorted(str(i) for i in job_ids)
    finally:
        client.close()


def test_session_timeouts_are_in_force_behind_a_session_pool(database: str, tmp_path: Path) -> None:
    """The drain SETs its timeouts after connecting and reads them back: a pooler cannot drop them."""
    with pgbouncer.pgbouncer(tmp_path, pool_mode="session", pool_size=2) as port:
        settings = config.Settings(dsn=through(database, port), statement_timeout_s=0.5, publish_timeout_s=2)
        conn = connection.connect(settings)
        try:
            shown = conn.execute("SHOW statement_timeout").fetchone()
            idle = conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()
            assert shown == ("500ms",) and idle == ("12s",)
            with pytest.raises(psycopg.errors.QueryCanceled):
                conn.execute("SELECT pg_sleep(3)")
        finally:
            conn.close()
