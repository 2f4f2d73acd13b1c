"""A stop has a deadline: SIGTERM with a half-open database link ends the drain within
``stop_timeout_s``, and a DSN libpq cannot parse ends ``drain run`` at once.

An independent review (issue 33, item 8) sent SIGTERM to a drain whose database link had gone
half-open (the peer stopped answering, the socket stayed open): it said it was stopping and was
still running at 60 s; its watchdog ended it at 144 s, so the shipped units (45 s) would have
SIGKILLed it. Now the whole stop has one deadline from the first signal: past it, one line and
exit 7, without waiting on the socket; the open transaction never committed, so nothing is lost.
And a DSN no library can parse made ``drain run`` retry for ever: it is a configuration mistake,
refused at load (exit 2, one line, no piece of the password).

The half-open link: a TCP proxy between the drain and PostgreSQL that stops forwarding but keeps
every socket open (tests/support/proxy.py, blackhole), so no keepalive or reset ever reaches the
drain.
"""

from __future__ import annotations

import signal
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from drain import cli
from tests import conftest
from tests.support import configs, faultload, processes, proxy
from tests.support.waiting import wait_until

STOP_TIMEOUT_S = 3.0
MARGIN_S = 4.0  # the process's own exit, and a loaded machine
ROWS = 20


@pytest.fixture
def postgres_proxy() -> Iterator[proxy.Proxy]:
    link = proxy.Proxy(conftest.PG_HOST, conftest.PG_PORT)
    try:
        yield link
    finally:
        link.close()


def through(dsn: str, port: int) -> str:
    parts = urllib.parse.urlsplit(dsn)
    user = parts.netloc.rsplit("@", 1)[0]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{port}"))


def test_sigterm_with_a_half_open_database_link_exits_within_the_deadline(
    database: str, postgres_proxy: proxy.Proxy, tmp_path: Path
) -> None:
    faultload.prepare(database)
    config = configs.write_config(
        tmp_path / "drain.toml",
        through(database, postgres_proxy.port),
        {"default": configs.memory()},
        stop_timeout_s=STOP_TIMEOUT_S,
    )
    drain = processes.start_drain(config, None, tmp_path / "drain.log")
    with processes.running(drain):
        wait_until("a leader", lambda: faultload.leader_pid(database) is not None, faultload.DEADLINE_S)
        postgres_proxy.set(proxy.BLACKHOLE)
        with psycopg.connect(database, autocommit=True) as conn:  # staged past the frozen link
            conn.execute(
                "INSERT INTO staged_jobs (job_name, job_args, job_kwargs, queue, backend, job_id, options)"
                " SELECT 'json.dumps', '[]', '{}', 'default', 'default', gen_random_uuid(), '{}'"
                " FROM generate_series(1, %s)",
                (ROWS,),
            )
        time.sleep(0.5)  # the leader's next statement is on the frozen link
        drain.signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = drain.wait(STOP_TIMEOUT_S + 30)
        took = time.monotonic() - signalled
    assert code == cli.EXIT_STOP_DEADLINE, drain.output()
    assert took < STOP_TIMEOUT_S + MARGIN_S, (took, drain.output())
    assert "stop_timeout_s (3s)" in drain.output()
    assert "most recent call first" not in drain.output()  # the deadline's line, not a watchdog dump
    postgres_proxy.set(proxy.RESET)  # the server's side of the link goes too, and the lock with it
    assert faultload.remaining(database) == ROWS  # nothing deleted, nothing lost


def test_run_with_a_dsn_libpq_cannot_parse_exits_at_once_in_one_line(tmp_path: Path) -> None:
    config = configs.write_config(tmp_path / "drain.toml", "", {"default": configs.memory()})
    started = time.monotonic()
    done = processes.drain_cli(
        "run", "--config", str(config), "--dsn", "postgresql://u:Secret%zzPass@127.0.0.1/x", dsn=None
    )
    assert time.monotonic() - started < 15  # at once: no reconnecting
    assert done.returncode == cli.EXIT_USAGE, done.stderr
    assert done.stderr.count("\n") == 1 and "the connection string cannot be parsed" in done.stderr
    assert "Secret" not in done.stderr + done.stdout and "Pass" not in done.stderr + done.stdout
