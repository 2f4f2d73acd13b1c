"""Shared fixtures: a fresh database per test, cloned from a migrated template, and service checks.

A service that is down skips the tests that need it locally, and fails them under CI=true.
Services are the machine's shared ones on loopback; tests use their own databases, Redis db
indexes and queue names, and never delete what they did not create.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from typing import NoReturn

import psycopg
import pytest

from drain import config
from drain.store import session as store
from tests.support.rig import leader, memory, rig  # noqa: F401 - fixtures for every folder

PG_HOST = os.environ.get("DRAIN_TEST_PGHOST", "127.0.0.1")
PG_PORT = int(os.environ.get("DRAIN_TEST_PGPORT", "5432"))
PG_USER = os.environ.get("DRAIN_TEST_PGUSER", "postgres")
TEMPLATE = f"drain_test_template_{os.getpid()}"
REDIS_URL = os.environ.get("DRAIN_TEST_REDIS", "redis://127.0.0.1:6379")
AMQP_URL = os.environ.get("DRAIN_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/%2F")


def admin_dsn(dbname: str = "postgres") -> str:
    return f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{dbname}"


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def missing(message: str) -> NoReturn:
    """Something a test needs is not here: skip locally, fail under CI=true (CI installs it)."""
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def need_service(name: str, host: str, port: int) -> None:
    """Skip (locally) or fail (CI=true) when a service is not listening."""
    if not port_open(host, port):
        missing(f"{name} is not listening on {host}:{port}")


def need_binary(name: str, package: str) -> str:
    """The path of a program the tests run; skip (locally) or fail (CI=true) without it."""
    found = shutil.which(name)
    if found is None:
        missing(f"{name} is not installed (Debian package {package})")
    return found


class ManualClock:
    """A monotonic clock that only moves when a test says so (pauses, ages, refresh intervals)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A database migrated once per session; each test clones it."""
    need_service("PostgreSQL", PG_HOST, PG_PORT)
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{TEMPLATE}"')
    settings = config.Settings(dsn=admin_dsn(TEMPLATE))
    db = store.Store(settings)
    db.migrate()
    db.close()
    yield TEMPLATE
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')


@contextlib.contextmanager
def fresh_database(template: str) -> Iterator[str]:
    """The DSN of a fresh database cloned from ``template``, dropped afterwards."""
    name = f"drain_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    try:
        yield admin_dsn(name)
    finally:
        with psycopg.connect(admin_dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def database(pg_template: str) -> Iterator[str]:
    """The DSN of a fresh, migrated database, dropped after the test."""
    with fresh_database(pg_template) as dsn:
        yield dsn


@pytest.fixture(scope="module")
def module_database(pg_template: str) -> Iterator[str]:
    """A fresh, migrated database shared by one module's tests (one long-lived drain per module)."""
    with fresh_database(pg_template) as dsn:
        yield dsn


@pytest.fixture
def settings(database: str) -> config.Settings:
    return config.Settings(dsn=database, poll_max_s=0.2, standby_retry_s=0.2, retry_base_s=0.05)


@pytest.fixture
def redis_db() -> Iterator[str]:
    """A Redis URL on a db index of its own; the keys the test made are deleted afterwards."""
    with claimed_redis_db() as url:
        yield url


@pytest.fixture(scope="module")
def module_redis_db() -> Iterator[str]:
    """``redis_db`` shared by one module's tests."""
    with claimed_redis_db() as url:
        yield url


@contextlib.contextmanager
def claimed_redis_db() -> Iterator[str]:
    """A Redis URL on a db index nobody else uses right now; the keys made meanwhile are deleted."""
    import redis

    need_service("Redis", "127.0.0.1", 6379)
    # Claim a db index nobody else uses right now (1..15) with a marker key.
    for index in range(1, 16):
        scoped = redis.Redis.from_url(f"{REDIS_URL}/{index}")
        if scoped.set("drain-test:claim", str(os.getpid()), nx=True, ex=3600):
            break
        scoped.close()
    else:  # pragma: no cover - all 15 in use
        pytest.fail("no free Redis db index")
    url = f"{REDIS_URL}/{index}"
    before = set(scoped.keys("*"))
    try:
        yield url
    finally:
        created = set(scoped.keys("*")) - before
        if created:
            scoped.delete(*created)
        scoped.delete("drain-test:claim")
        scoped.close()
