"""A private PgBouncer for one test: its own ini in a temp dir, a free loopback port, stopped by PID.

It points at the shared Postgres (trust auth) and forwards every database name. It ignores no
``options`` startup parameter: the drain sets its timeouts with SET after connecting, so a
pooler that would drop them cannot (tests/faults/test_pgbouncer.py checks they are in force).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests import conftest
from tests.support import faultload
from tests.support.waiting import wait_until

CANDIDATES = ("pgbouncer", "/usr/sbin/pgbouncer")
START_TIMEOUT_S = 30.0


def binary() -> str | None:
    for candidate in CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    return None


def need_pgbouncer() -> str:
    """The pgbouncer binary; skip (locally) or fail (CI=true) without one."""
    found = binary()
    if found is None:
        conftest.missing("pgbouncer is not installed (apt-get install pgbouncer)")
    return found


@contextlib.contextmanager
def pgbouncer(
    directory: Path,
    *,
    pool_mode: str,
    pool_size: int = 4,
    pg_host: str = conftest.PG_HOST,
    pg_port: int = conftest.PG_PORT,
    user: str = "postgres",
) -> Iterator[int]:
    """Run PgBouncer in ``pool_mode`` until the block ends; yield its port."""
    executable = need_pgbouncer()
    port = faultload.free_port()
    (directory / "users.txt").write_text(f'"{user}" ""\n')
    ini = directory / "pgbouncer.ini"
    ini.write_text(
        "[databases]\n"
        f"* = host={pg_host} port={pg_port}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "unix_socket_dir =\n"
        "auth_type = trust\n"
        f"auth_file = {directory / 'users.txt'}\n"
        f"pool_mode = {pool_mode}\n"
        f"default_pool_size = {pool_size}\n"
        "max_client_conn = 50\n"
        "ignore_startup_parameters = extra_float_digits\n"
    )
    # PgBouncer refuses to run as root: drop to the postgres user after reading the ini.
    command = [executable, *(["-u", "postgres"] if os.geteuid() == 0 else []), str(ini)]
    log = (directory / "pgbouncer.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:

        def listening() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
            if process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited: {(directory / 'pgbouncer.log').read_text()}")
            return False

        wait_until("pgbouncer to listen", listening, START_TIMEOUT_S)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        log.close()
