"""A private Redis Sentinel topology: a master, a replica and three sentinels on free loopback ports.

Each process has its own directory under the test's tmp dir (the sentinels' config files, which
Sentinel rewrites, live there) and is stopped by PID. The sentinels decide quickly
(``down-after-milliseconds`` 1 s, quorum 2), so a SIGKILLed master is replaced within seconds.
:meth:`SentinelTopology.fail_over` kills the master, waits for the promotion, and starts the old
master again as a replica of the new one (as an operator's restart does once Sentinel has moved on).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import redis

from tests.support import faultload, redis_server
from tests.support.waiting import wait_until

MASTER_NAME = "drainmaster"
QUORUM = 2
DOWN_AFTER_MS = 1_000
FAILOVER_TIMEOUT_MS = 5_000
TIMEOUT_S = 60.0
NODE_ARGS = ("--repl-diskless-sync-delay", "0")  # a replica syncs at once, not after Redis's 5 s


class SentinelProcess:
    """One ``redis-server --sentinel`` with its config file in ``directory``."""

    def __init__(self, directory: Path, master_port: int) -> None:
        self.directory = directory
        self.port = faultload.free_port()
        self.config = directory / "sentinel.conf"
        self.config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {directory}\nlogfile {directory / 'sentinel.log'}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} {QUORUM}\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
        )
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.process = subprocess.Popen(
            [binary, str(self.config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def client(self) -> redis.Redis[bytes]:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def master(self) -> dict[str, object] | None:
        """This sentinel's view of the master (None while it cannot answer)."""
        client = self.client()
        try:
            state: dict[str, object] = client.sentinel_master(MASTER_NAME)
            return state
        except redis.RedisError:
            return None
        finally:
            client.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


class SentinelTopology:
    """Two data nodes (one master, one replica at a time) and three sentinels."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.nodes = [self._node("node-a"), self._node("node-b")]
        self.sentinels: list[SentinelProcess] = []

    def _node(self, name: str) -> redis_server.RedisServer:
        path = self.directory / name
        path.mkdir()
        return redis_server.RedisServer(path, appendonly=False)

    @property
    def sentinel_addresses(self) -> list[str]:
        return [f"127.0.0.1:{sentinel.port}" for sentinel in self.sentinels]

    def start(self) -> None:
        first, second = self.nodes
        first.start(*NODE_ARGS)
        second.start(*NODE_ARGS, "--replicaof", "127.0.0.1", str(first.port))
        wait_until("the replica to sync", lambda: self._linked(second), TIMEOUT_S)
        for index in range(3):
            path = self.directory / f"sentinel-{index}"
            path.mkdir()
            self.sentinels.append(SentinelProcess(path, first.port))
        wait_until("the sentinels to see the replica and each other", self._agreed, TIMEOUT_S)

    def _agreed(self) -> bool:
        """Every sentinel knows the master, the replica, and the two other sentinels."""
        for sentinel in self.sentinels:
            state = sentinel.master()
            if not state or int(str(state.get("num-slaves", 0))) < 1:
                return False
            if int(str(state.get("num-other-sentinels", 0))) < len(self.sentinels) - 1:
                return False
        return True

    @staticmethod
    def _linked(replica: redis_server.RedisServer) -> bool:
        with contextlib.closing(replica.client()) as client:
            info = client.info("replication")
        return info.get("role") == "slave" and info.get("master_link_status") == "up"

    def master(self) -> redis_server.RedisServer:
        """The node the sentinels name as master (and that says so itself)."""
        ports = {int(str(state["port"])) for state in (s.master() for s in self.sentinels) if state}
        (port,) = ports
        (node,) = [node for node in self.nodes if node.port == port]
        return node

    def fail_over(self) -> redis_server.RedisServer:
        """SIGKILL the master; wait until the sentinels promoted the replica; start the old master
        again as its replica. Returns the new master."""
        old = self.master()
        (new,) = [node for node in self.nodes if node is not old]
        old.kill()

        def promoted() -> bool:
            states = [sentinel.master() for sentinel in self.sentinels]
            if not all(state and int(str(state["port"])) == new.port for state in states):
                return False
            with contextlib.closing(new.client()) as client:
                return client.info("replication").get("role") == "master"

        wait_until("the sentinels to promote the replica", promoted, TIMEOUT_S)
        old.start(*NODE_ARGS, "--replicaof", "127.0.0.1", str(new.port))
        try:
            wait_until("the old master to sync as a replica", lambda: self._linked(old), TIMEOUT_S)
        except AssertionError as exc:
            with contextlib.closing(old.client()) as client:
                state = client.info("replication")
            tail = (old.directory / "redis.log").read_text(errors="replace").splitlines()[-15:]
            raise AssertionError(f"{exc}: {state}\n" + "\n".join(tail)) from None
        return new

    def stop(self) -> None:
        for sentinel in self.sentinels:
            with contextlib.suppress(Exception):
                sentinel.stop()
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()


@contextlib.contextmanager
def running(directory: Path) -> Iterator[SentinelTopology]:
    topology = SentinelTopology(directory)
    try:
        topology.start()
        yield topology
    finally:
        topology.stop()
