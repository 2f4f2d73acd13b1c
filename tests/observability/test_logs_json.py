"""log_format = "json" end to end: a real ``drain run`` whose every stderr line is a JSON object,
through a batch, a Redis outage and its recovery, a database outage, and SIGTERM — and whose
lines never hold the password of its DSN or of its broker URL.

The drain connects as a role of the test's own with a password (the server trusts loopback, so
the password is not checked, but it is in the DSN the drain holds, which is what matters), and to
a private redis-server with ``requirepass``; both through a TCP proxy the test cuts.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from psycopg import sql

from drain.staging import sync as staging
from tests import conftest
from tests.deploy import files
from tests.support import configs, processes, proxy
from tests.support.redis_server import RedisServer
from tests.support.waiting import wait_until

REQUIRED = ("time", "level", "logger", "message")
JOB = "tests.support.faultload.noop"


@pytest.fixture
def role_with_password(database: str) -> Iterator[tuple[str, str]]:
    """(role, password): a login role with the grants of deploy/database/drain-role.sql; dropped
    afterwards."""
    name = f"drain_logs_{uuid.uuid4().hex[:10]}"
    password = f"pgpw-{uuid.uuid4().hex}"
    with psycopg.connect(conftest.admin_dsn(), autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(name), sql.Literal(password))
        )
    try:
        grants = re.sub(r"\bTO drain;", f"TO {name};", files.GRANTS.read_text())
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(grants.encode())
        yield name, password
    finally:
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        with psycopg.connect(conftest.admin_dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[tuple[RedisServer, str]]:
    """A redis-server of this test's own that requires a password: (server, password)."""
    conftest.need_binary("redis-server", "redis-server")
    server = RedisServer(tmp_path)
    server.start()
    password = f"redispw-{uuid.uuid4().hex}"
    try:
        client = redis.Redis.from_url(server.url)
        client.config_set("requirepass", password)
        client.close()
        yield server, password
    finally:
        server.stop()


def stage(dsn: str, queue: str, count: int) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        staging.stage_many(conn, [staging.Job(JOB, args=[n], queue=queue) for n in range(count)])


def remaining(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    return int(row[0]) if row else -1


def records(log: str) -> list[dict[str, Any]]:
    """Every line of the drain's stderr as a JSON object with the required keys (or fail)."""
    found = []
    for number, line in enumerate(log.splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"line {number} is not JSON: {line!r}") from None
        assert isinstance(record, dict), line
        missing = [key for key in REQUIRED if key not in record]
        assert not missing, f"line {number} lacks {missing}: {line}"
        found.append(record)
    return found


def events(drain: processes.Process, name: str) -> list[dict[str, Any]]:
    """The complete lines so far whose ``event`` is ``name`` (a line being written is skipped)."""
    complete = drain.output().rpartition("\n")[0]
    return [record for record in records(complete) if record.get("event") == name]


def test_every_line_is_json_with_its_fields_and_no_password(
    database: str,
    role_with_password: tuple[str, str],
    private_redis: tuple[RedisServer, str],
    tmp_path: Path,
) -> None:
    role, pg_password = role_with_password
    server, redis_password = private_redis
    pg_proxy = proxy.Proxy(conftest.PG_HOST, conftest.PG_PORT)
    redis_proxy = proxy.Proxy("127.0.0.1", server.port)
    queue = f"logs-{uuid.uuid4().hex[:8]}"
    dbname = database.rsplit("/", 1)[1]
    dsn = f"postgresql://{role}:{pg_password}@127.0.0.1:{pg_proxy.port}/{dbname}"
    broker = f"redis://:{redis_password}@127.0.0.1:{redis_proxy.port}/0"
    config = configs.write_config(
        tmp_path / "drain.toml",
        dsn,
        {"default": configs.rq(broker, socket_timeout_s=1)},
        log_format="json",
        log_level="DEBUG",
        retry_max_s=0.5,
    )
    drain = processes.start_drain(config, None, tmp_path / "drain.log")
    try:
        # a batch forwarded
        wait_until("the drain to lead", lambda: events(drain, "leading"), 60)
        stage(database, queue, 7)
        wait_until("the first jobs to be forwarded", lambda: remaining(database) == 0, 60)
        published = wait_until("a published line", lambda: events(drain, "published"), 30)

        # the broker goes away, and comes back
        redis_proxy.set(proxy.RESET)
        stage(database, queue, 3)
        wait_until("the outage to be logged", lambda: events(drain, "backend_unavailable"), 60)
        redis_proxy.set(proxy.PASS)
        wait_until("the recovery to be logged", lambda: events(drain, "backend_available"), 60)
        wait_until("the jobs staged in the outage", lambda: remaining(database) == 0, 60)

        # the database goes away: the leader steps down, and leads again
        pg_proxy.set(proxy.RESET)
        wait_until("the lost leadership", lambda: events(drain, "lost_leadership"), 60)
        wait_until("a failed reconnect", lambda: events(drain, "database_error"), 60)
        pg_proxy.set(proxy.PASS)
        wait_until("the drain to lead again", lambda: len(events(drain, "leading")) >= 2, 60)
    finally:
        code = drain.stop()
        pg_proxy.close()
        redis_proxy.close()
    log = drain.output()
    assert code == 0, log[-3000:]
    assert log.endswith("\n")
    lines = records(log)

    assert pg_password not in log and redis_password not in log
    assert all(record["time"].endswith("Z") for record in lines)

    first = published[0]
    assert (first["level"], first["logger"], first["backend"], first["queue"]) == (
        "DEBUG",
        "drain.relay.reporting",
        "default",
        queue,
    )
    assert first["batch_size"] == len(first["job_ids"]) >= 1
    assert all(isinstance(job_id, str) and uuid.UUID(job_id) for job_id in first["job_ids"])
    batches = [record for record in lines if record.get("event") == "batch"]
    assert batches and all(isinstance(record["batch_size"], int) for record in batches)
    assert sum(record["published"] for record in batches) == 10

    (leading, *_) = [record for record in lines if record.get("event") == "leading"]
    assert (leading["role"], leading["level"]) == ("leader", "INFO")
    outage = next(record for record in lines if record.get("event") == "backend_unavailable")
    assert (outage["level"], outage["backend"]) == ("WARNING", "default")
    assert outage["reason"] and outage["attempts"] >= 1 and outage["retry_in_s"] > 0
    lost = next(record for record in lines if record.get("event") == "lost_leadership")
    assert (lost["role"], lost["level"]) == ("standby", "WARNING") and lost["reason"]
    # the reconnect's error names the database by its URL: with the password masked
    reconnect = next(record for record in lines if record.get("event") == "database_error")
    assert f"postgresql://{role}:***@127.0.0.1:{pg_proxy.port}/{dbname}" in reconnect["message"]

    stopping = next(record for record in lines if record.get("event") == "stopping")
    assert (stopping["level"], stopping["logger"], stopping["signal"]) == ("INFO", "drain", "SIGTERM")
    released = next(record for record in lines if record.get("event") == "released")
    assert released["role"] == "standby"
    assert lines.index(stopping) < lines.index(released)


def test_the_watchdog_logs_a_json_line_before_its_plain_text_stack_dump(
    database: str, tmp_path: Path
) -> None:
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.memory()}, log_format="json", watchdog_s=2
    )
    stage(database, f"logs-{uuid.uuid4().hex[:8]}", 1)
    # sleep releases the GIL, so the watchdog's Python thread can still log (a spin would not)
    drain = processes.start_drain(config, None, tmp_path / "drain.log", failpoints="after_commit=sleep:60")
    with processes.running(drain):
        code = drain.wait(60)
    log = drain.output()
    assert code == 1, log[-3000:]  # faulthandler's exit
    lines, _, dump = log.partition("Timeout (")  # the dump: plain text, by nature
    (expiring,) = [record for record in records(lines) if record.get("event") == "watchdog_expiring"]
    assert (expiring["level"], expiring["logger"], expiring["bound_s"]) == (
        "CRITICAL",
        "drain.relay.watchdog",
        2.0,
    )
    assert "most recent call first" in dump and "failpoints.py" in dump
