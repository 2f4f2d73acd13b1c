"""A private redis-server with an fsync-always append-only file, to SIGKILL and restart."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from tests.support import faultload, ledger


class RedisServer:
    """``redis-server`` on a free loopback port, with its data and log under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.directory = directory
        self.port = faultload.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--dir", str(self.directory),
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ledger.wait_until(self._ready, 60, f"redis-server on port {self.port}")

    def _ready(self) -> bool:
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
