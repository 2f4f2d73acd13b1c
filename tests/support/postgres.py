"""A private PostgreSQL cluster (initdb in a temp dir, a free loopback port) to crash and restart,
and a primary with a streaming standby (``pg_basebackup -R``) to fail over.

Run as root, the binaries run as the ``postgres`` user (initdb refuses root), so the cluster lives
in a directory that user owns.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg

from drain import config
from drain.store import session as store
from tests import conftest
from tests.support import faultload
from tests.support.waiting import wait_until

BIN = Path(os.environ.get("DRAIN_TEST_PGBIN", "/usr/lib/postgresql/15/bin"))


def available() -> bool:
    return (BIN / "initdb").exists() and (BIN / "pg_ctl").exists()


class PrivatePostgres:
    """initdb + pg_ctl on a free port; ``crash()`` is ``pg_ctl stop -m immediate``.

    ``replica_of``: a hot standby of that cluster instead (``pg_basebackup -R``, streaming).
    ``options``: more ``-c name=value`` server options, for this cluster only (not its standbys).
    """

    def __init__(self, *, replica_of: PrivatePostgres | None = None, options: str = "") -> None:
        self.options = options
        self.port = faultload.free_port()
        self.root = Path(tempfile.mkdtemp(prefix="drain-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self._user: dict[str, Any] = {}
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._user = {"user": entry.pw_uid, "group": entry.pw_gid}
        if replica_of is None:
            self._run(str(BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")
        else:
            source = ("-h", "127.0.0.1", "-p", str(replica_of.port), "-U", "postgres", "-X", "stream")
            self._run(str(BIN / "pg_basebackup"), *source, "-D", str(self.data), "-R", "--no-sync")
        self.start()

    def _run(self, *command: str) -> None:
        subprocess.run(command, check=True, capture_output=True, timeout=120, **self._user)

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off {self.options}"
        self._run(
            str(BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start"
        )

    def kill(self) -> None:
        """SIGKILL the postmaster (its PID from postmaster.pid), as a dying host would; its
        backends exit when they see it gone. Returns once the port refuses connections."""
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        wait_until("the port to close", lambda: not conftest.port_open("127.0.0.1", self.port), 30)

    def promote(self) -> None:
        """A standby becomes a primary (``pg_ctl promote``, waiting until it accepts writes)."""
        self._run(str(BIN / "pg_ctl"), "-D", str(self.data), "-w", "promote")

    def crash(self) -> None:
        """Stop with ``-m immediate``: no checkpoint, every session cut; recovery on next start."""
        self._run(str(BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def stop(self) -> None:
        subprocess.run(
            [str(BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            timeout=120,
            check=False,
            **self._user,
        )
        shutil.rmtree(self.root, ignore_errors=True)

    def migrated_database(self, name: str = "drain_faults") -> str:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        dsn = self.dsn(name)
        db = store.Store(config.Settings(dsn=dsn))
        db.migrate()
        db.close()
        faultload.prepare(dsn)
        return dsn


class StreamingPair:
    """A private primary and a hot standby streaming from it, synchronously: a commit returns once
    the standby has it, so what a producer saw committed survives a promotion. (A transaction
    is visible on the primary a moment before the standby confirms it: a primary that dies in
    that moment may have shown the drain a job the promoted standby never got.)"""

    def __init__(self) -> None:
        self.primary = PrivatePostgres(options="-c synchronous_standby_names=*")
        try:
            self.standby = PrivatePostgres(replica_of=self.primary)
        except BaseException:
            self.primary.stop()
            raise

    def dsn(self, dbname: str, *hosts: PrivatePostgres, attrs: str | None = "read-write") -> str:
        """A libpq multi-host URL (default: primary, then standby)."""
        listed = ",".join(f"127.0.0.1:{host.port}" for host in hosts or (self.primary, self.standby))
        query = f"?target_session_attrs={attrs}" if attrs else ""
        return f"postgresql://postgres@{listed}/{dbname}{query}"

    def replicated(self, dbname: str) -> None:
        """Wait until the standby has the database (and what committed before it)."""

        def there() -> bool:
            try:
                with psycopg.connect(self.standby.dsn(dbname), connect_timeout=3):
                    return True
            except psycopg.OperationalError:
                return False

        wait_until(f"database {dbname} on the standby", there, 30)

    def stop(self) -> None:
        self.standby.stop()
        self.primary.stop()


def terminate(admin: psycopg.Connection[Any], pid: int) -> None:
    """pg_terminate_backend(pid) from ``admin``, and wait until that backend is gone."""
    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    wait_until(
        f"backend {pid} to end",
        lambda: not admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone(),
        60,
        interval_s=0.01,
    )
