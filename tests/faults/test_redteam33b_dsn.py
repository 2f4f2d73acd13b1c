"""Red team (issue 33, second pass): a DSN libpq parses but can never use is retried for ever.

Finding: ``dsn_params`` refuses at load only what libpq cannot *parse*. A DSN whose values libpq
refuses when connecting (``sslmode=bogus``, ``port=notaport``, ``connect_timeout=abc``,
``target_session_attrs=bogus``, ``service=`` naming no service) passes the load, and ``drain
run`` then treats libpq's "connection is bad: invalid sslmode value" as a database outage: one
WARNING, and it retries for ever, as if the server were down, while ``drain status`` with the
same DSN exits at once. No retry can heal it; the supervisor sees a running process.

Expected: ``drain run`` refuses it in one line and exits 2 (a configuration mistake), as it does
for an unparseable DSN. Observed: still running after 8 s, retrying.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support import processes


@pytest.mark.parametrize(
    "dsn",
    [
        "host=127.0.0.1 port=5432 dbname=postgres user=postgres sslmode=bogus",
        "postgresql://postgres@127.0.0.1:notaport/postgres",
        # a %-escape that decodes to no UTF-8: psycopg's parser raised UnicodeDecodeError at the
        # first connection, past the load, and the process ended with a stack dump
        "postgresql://postgres:%82Pw0rdPiece@127.0.0.1:5432/postgres",
    ],
)
def test_drain_run_refuses_a_dsn_libpq_will_never_use(dsn: str, tmp_path: Path) -> None:
    config = tmp_path / "drain.toml"
    config.write_text(
        '[backends.default]\ntype = "rq"\nurl = "redis://127.0.0.1:6379/15"\nallowed_jobs = ["a.b"]\n'
    )
    env = processes.environment(None, {"DRAIN_DSN": dsn})
    drain = subprocess.Popen(
        [processes.DRAIN, "run", "--config", str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        code = drain.wait(timeout=8)
    except subprocess.TimeoutExpired:
        drain.kill()
        output, _ = drain.communicate(timeout=30)
        pytest.fail(f"drain run still retrying after 8 s:\n{output}")
    output = drain.communicate(timeout=30)[0]
    assert code == 2, output
    assert "Pw0rdPiece" not in output
