"""Red team 32: a key's 255 bytes are the database encoding's bytes at the table's check, UTF-8
bytes at the drain.

drain_key_check_v1 tests ``octet_length(ordering_key) <= 255``: in a LATIN1 database that counts
LATIN1 bytes (one per 'é'). The drain reads the row in UTF-8 (two bytes per 'é') and refuses a key
over 255 UTF-8 bytes (reading._key). So a key the table accepted, staged by drain_stage_v2, is
never forwarded: refused max_attempts times, then dead-lettered — and the key's next row goes
on. database.md: "Any database encoding works"; staging.md: the key is "1 to 255 bytes of UTF-8",
refused at INSERT otherwise.

Red before main's 076f84e (window looks everywhere every 16th select and after an empty one;
keys bounded in characters; a retried keyed row above the identity gets a new id); kept as a
regression test.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from drain import config, testing
from drain.relay import loop as relay
from drain.store import session as store
from tests import conftest
from tests.support.waiting import wait_until


@pytest.fixture
def latin1_database(pg_template: str) -> Iterator[str]:  # pg_template: PostgreSQL is up
    name = f"drain_test_latin1_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(conftest.admin_dsn(), autocommit=True) as conn:
        conn.execute(
            f"CREATE DATABASE \"{name}\" TEMPLATE template0 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C'"
        )
    try:
        yield conftest.admin_dsn(name)
    finally:
        with psycopg.connect(conftest.admin_dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_key_the_table_accepts_is_forwarded_not_dead_lettered(latin1_database: str) -> None:
    settings = config.Settings(
        dsn=latin1_database,
        retry_base_s=0.01,
        retry_max_s=0.05,
        backends={"default": config.BackendSettings("default", "memory", 2, {})},
    )
    store.Store(settings).migrate()
    key = "é" * 200  # 200 bytes in LATIN1, 400 in UTF-8
    with psycopg.connect(latin1_database, autocommit=True) as conn:
        conn.execute("SELECT drain_stage_v2('app.first', ordering_key => %s)", (key,))  # accepted
        conn.execute("SELECT drain_stage_v2('app.second', ordering_key => %s)", (key,))
        memory = testing.MemoryAdapter("default")
        the_relay = relay.Relay(settings, {"default": memory})
        try:
            assert the_relay.leadership.try_acquire()

            def settled() -> bool:
                the_relay.drain_once()
                return conn.execute("SELECT count(*) FROM staged_jobs").fetchone() == (0,)

            wait_until("the table to empty", settled, 30)
        finally:
            the_relay.shutdown()
        dead = conn.execute("SELECT job_name, error FROM staged_jobs_dead").fetchall()
    # both forwarded, in order, with their key. (red team 32 found otherwise)
    assert dead == [], dead
    assert [(job.job_name, job.ordering_key) for job in memory.published] == [
        ("app.first", key),
        ("app.second", key),
    ]
