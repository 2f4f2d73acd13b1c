"""A private redis-server (by default with an fsync-always append-only file), to SIGKILL and restart.

``args`` adds command-line settings (``--replicaof``, ``--key-load-delay``, ...); ``appendonly=False``
keeps it to RDB snapshots; protected configs (``dir``) and DEBUG are allowed from loopback, for the
tests that make it refuse writes.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from tests.support import faultload
from tests.support.waiting import wait_until


class RedisServer:
    """``redis-server`` on a free loopback port, with its data and log under ``directory``."""

    def __init__(self, directory: Path, *, appendonly: bool = True) -> None:
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.directory = directory
        self.appendonly = appendonly
        self.port = faultload.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, *args: str, wait: bool = True) -> None:
        """Start with ``args`` added; ``wait``: until it answers PING (not while it loads)."""
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else []
        command = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            *persistence,
            "--dir", str(self.directory),
            "--logfile", str(self.directory / "redis.log"),
            "--enable-protected-configs", "local",
            "--enable-debug-command", "local",
            *args,
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if wait:
            wait_until(f"redis-server on port {self.port}", self.answers, 60)

    def client(self, db: int = 0) -> redis.Redis[bytes]:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, socket_timeout=10)

    def answers(self) -> bool:
        client = redis.Redis.from_url(self.url, socket_timeout=2)
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError):
            return False
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL, by PID; wait for the process to be gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
            self.kill()
        self.process = None

    def downtime(self, seconds: float) -> None:
        """Kill, stay down ``seconds``, start again on the same port and data."""
        self.kill()
        time.sleep(seconds)
        self.start()


@contextlib.contextmanager
def running(directory: Path, *, appendonly: bool = True) -> Iterator[RedisServer]:
    """A started RedisServer with its data under ``directory`` (made if missing), stopped on exit."""
    directory.mkdir(parents=True, exist_ok=True)
    server = RedisServer(directory, appendonly=appendonly)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def replicated(directory: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A master and its replica (no append-only file), linked on both sides (the master counts a
    replica online only a moment after the replica's link is up); a replica left stopped
    (SIGSTOP) is continued before both stop."""
    (directory / "master").mkdir(parents=True, exist_ok=True)
    (directory / "replica").mkdir(parents=True, exist_ok=True)
    master = RedisServer(directory / "master", appendonly=False)
    replica = RedisServer(directory / "replica", appendonly=False)
    try:
        master.start()
        replica.start("--replicaof", "127.0.0.1", str(master.port))

        def linked() -> bool:
            with contextlib.closing(replica.client()) as client:
                if client.info("replication").get("master_link_status") != "up":
                    return False
            with contextlib.closing(master.client()) as client:
                slave = client.info("replication").get("slave0")
                return isinstance(slave, dict) and slave.get("state") == "online"

        wait_until("the replica to sync", linked, 30)
        yield master, replica
    finally:
        if replica.process is not None and replica.process.poll() is None:
            replica.process.send_signal(signal.SIGCONT)
        replica.stop()
        master.stop()
