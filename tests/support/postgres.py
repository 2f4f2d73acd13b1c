"""A private PostgreSQL cluster (initdb in a temp dir, a free loopback port) to crash and restart.

Run as root, the binaries run as the ``postgres`` user (initdb refuses root), so the cluster lives
in a directory that user owns.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg

from drain import config, store
from tests.support import faultload

BIN = Path(os.environ.get("DRAIN_TEST_PGBIN", "/usr/lib/postgresql/15/bin"))


def available() -> bool:
    return (BIN / "initdb").exists() and (BIN / "pg_ctl").exists()


class PrivatePostgres:
    """initdb + pg_ctl on a free port; ``crash()`` is ``pg_ctl stop -m immediate``."""

    def __init__(self) -> None:
        self.port = faultload.free_port()
        self.root = Path(tempfile.mkdtemp(prefix="drain-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self._user: dict[str, Any] = {}
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._user = {"user": entry.pw_uid, "group": entry.pw_gid}
        self._run(str(BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")
        self.start()

    def _run(self, *command: str) -> None:
        subprocess.run(command, check=True, capture_output=True, timeout=120, **self._user)

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off"
        self._run(
            str(BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start"
        )

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
