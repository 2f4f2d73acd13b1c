"""A database created with ENCODING 'SQL_ASCII', where psycopg hands text over as bytes: the drain
migrates it, is woken by a producer's commit, forwards what was staged (non-ASCII names and
arguments included), refuses a row whose name is not UTF-8 and shows it dead-lettered, and its
status is JSON. Before, the wake-up LISTENed on ``b'drain_wake_...'`` (never woken), a
notification payload psycopg could not decode as ASCII ended the relay's thread, and the
migration and status reports read names as bytes."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from drain import cli, config, stage, testing
from drain.relay import loop as relay
from drain.store import admin, connection
from drain.store import session as store
from tests import conftest
from tests.support.waiting import wait_until

DEADLINE_S = 20.0


@pytest.fixture
def ascii_database(pg_template: str) -> Iterator[str]:  # pg_template: PostgreSQL is up
    name = f"drain_test_ascii_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(conftest.admin_dsn(), autocommit=True) as conn:
        conn.execute(
            f"CREATE DATABASE \"{name}\" TEMPLATE template0 ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C'"
        )
    try:
        yield conftest.admin_dsn(name)
    finally:
        with psycopg.connect(conftest.admin_dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def running(ascii_database: str) -> Iterator[tuple[relay.Relay, testing.MemoryAdapter]]:
    """A migrated SQL_ASCII database and a relay over a memory backend, leading in a thread; it
    sleeps at least 2.5 s once armed, so a job forwarded sooner was a notification's."""
    settings = config.Settings(
        dsn=ascii_database,
        poll_min_s=5.0,
        poll_max_s=5.0,
        wakeup_poll_max_s=30.0,
        standby_retry_s=0.2,
        retry_base_s=0.01,
        retry_max_s=0.05,
        backends={"default": config.BackendSettings("default", "memory", 2, {})},
    )
    report = store.Store(settings).migrate()
    assert report.not_valid == []  # was ["b''"]: a name read as bytes
    memory = testing.MemoryAdapter("default")
    the_relay = relay.Relay(settings, {"default": memory})
    stop = threading.Event()
    failures: list[BaseException] = []

    def run() -> None:
        try:
            the_relay.run(stop)
        except BaseException as exc:
            failures.append(exc)
            raise

    thread = threading.Thread(target=run, name="relay", daemon=True)
    thread.start()
    try:
        yield the_relay, memory
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not failures, failures
    assert not thread.is_alive()


def armed(the_relay: relay.Relay) -> bool:
    assert the_relay.wakeup is not None
    return the_relay.wakeup.armed


def test_the_drain_stages_drains_and_wakes_up_on_a_sql_ascii_database(
    ascii_database: str, running: tuple[relay.Relay, testing.MemoryAdapter]
) -> None:
    the_relay, memory = running
    assert the_relay.wakeup is not None
    with psycopg.connect(ascii_database) as app:
        assert app.info.encoding == "ascii"  # psycopg's name for SQL_ASCII: text comes as bytes
    wait_until("the leader asleep, armed", lambda: armed(the_relay), DEADLINE_S)

    with psycopg.connect(ascii_database) as app:
        job_id = stage(app, "app.tâches.envoyer", args=["é", 1], kwargs={"ß": "✓"}, queue="café")
    wait_until("the job forwarded", lambda: memory.published, DEADLINE_S)
    (job,) = memory.published
    assert (job.job_id, job.job_name, job.queue) == (job_id, "app.tâches.envoyer", "café")
    assert (list(job.args), dict(job.kwargs)) == (["é", 1], {"ß": "✓"})
    assert the_relay.wakeup.notified >= 1 and the_relay.wakeup.missed == 0

    # a payload psycopg cannot decode as ASCII wakes the leader like any other
    wait_until("the leader asleep again", lambda: armed(the_relay), DEADLINE_S)
    notified = the_relay.wakeup.notified
    with psycopg.connect(ascii_database, autocommit=True) as other:
        channel = "'drain_wake_' || to_hex(hashtextextended('drain-wake:public.staged_jobs', 0))"
        other.execute(f"SELECT pg_notify({channel}, %s)", ("réveil",))
    wait_until("the odd notification", lambda: the_relay.wakeup.notified > notified, DEADLINE_S)


def test_a_name_that_is_not_utf8_is_refused_and_shown_dead(
    ascii_database: str,
    running: tuple[relay.Relay, testing.MemoryAdapter],
    capsys: pytest.CaptureFixture[str],
) -> None:
    the_relay, memory = running
    with psycopg.connect(ascii_database) as app:
        app.execute(
            "INSERT INTO staged_jobs (job_name) VALUES (convert_from('\\x6170702eff'::bytea, 'SQL_ASCII'))"
        )
    db = store.Store(the_relay.settings)
    try:
        wait_until("the row dead-lettered", lambda: db.status()["dead"] == 1, DEADLINE_S)
        (dead,) = admin.Admin(db.conn, db.names).dead_list(admin.DeadFilter())
        assert dead["job_name"] == "app.\ufffd" and "job_name is not UTF-8" in dead["error"]
    finally:
        db.close()
    assert memory.published == []

    env = {"DRAIN_DSN": ascii_database}
    assert cli.main(["dead", "list", "--json"], env=env) == 0
    (shown,) = json.loads(capsys.readouterr().out)
    assert shown["job_name"] == "app.\ufffd"
    assert cli.main(["status", "--json"], env=env) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["leader"]["application_name"].startswith("drain/") and status["dead"] == 1


def test_the_drains_sessions_read_text_as_text(ascii_database: str) -> None:
    conn = connection.connect(config.Settings(dsn=ascii_database))
    try:
        row = conn.execute(
            "SELECT current_user, %s::text, 'x'::name, convert_from('\\xff', 'SQL_ASCII')", ("ñ",)
        )
        assert row.fetchone() == ("postgres", "ñ", "x", b"\xff")  # not UTF-8: bytes, as decoding expects
    finally:
        conn.close()
