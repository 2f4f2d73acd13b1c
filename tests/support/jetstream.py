"""NATS JetStream helpers for tests: uniquely named streams on the shared server (created and
deleted by the test, only those), reading a stream back by ``Nats-Msg-Id``, and a private
3-node JetStream cluster on free loopback ports for the tests that kill a server.

The cluster's servers are child processes (``nats-server``), each with its own store directory in
a temporary directory; they are stopped by PID, never by name. nats-py (the client consumers use)
reads the streams back, through ``asyncio.run`` per call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.api
import nats.js.errors

from tests import conftest
from tests.support import faultload
from tests.support.waiting import wait_until

SHARED_URL = os.environ.get("DRAIN_TEST_NATS", "nats://127.0.0.1:4222")
READY_TIMEOUT_S = 30.0
NO_PEERS_FOR_PLACEMENT = 10005  # JetStream's err_code for a stream no set of known peers can hold


def need_nats() -> None:
    host, _, port = SHARED_URL.removeprefix("nats://").partition(":")
    conftest.need_service("NATS", host, int(port or 4222))


def unique_name(prefix: str = "DRAIN_TEST") -> str:
    """A stream name (and subject prefix) no other test uses: letters, digits and ``_``."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


async def _connect(urls: Sequence[str]) -> Any:
    return await nats.connect(list(urls), connect_timeout=5, max_reconnect_attempts=3, allow_reconnect=True)


def add_stream(urls: Sequence[str], name: str, subjects: Sequence[str], **config: Any) -> None:
    """Create stream ``name`` (``config``: StreamConfig fields, e.g. ``num_replicas``, ``max_msgs``).
    A cluster that has just elected its meta leader may not know every peer yet: a replicated
    stream is refused as "no suitable peers for placement" for a moment, and tried again."""

    async def run() -> bool:
        client = await _connect(urls)
        try:
            await client.jetstream().add_stream(name=name, subjects=list(subjects), **config)
            return True
        except nats.js.errors.BadRequestError as error:
            if error.err_code != NO_PEERS_FOR_PLACEMENT:
                raise
            return False
        finally:
            await client.close()

    wait_until(f"stream {name} placed", lambda: asyncio.run(run()), READY_TIMEOUT_S, 0.5)


def delete_stream(urls: Sequence[str], name: str) -> None:
    async def run() -> None:
        client = await _connect(urls)
        try:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await client.jetstream().delete_stream(name)
        finally:
            await client.close()

    asyncio.run(run())


@contextlib.contextmanager
def stream(
    name: str, subjects: Sequence[str], urls: Sequence[str] = (SHARED_URL,), **config: Any
) -> Iterator[str]:
    """A stream of the test's own for the block, deleted afterwards (only it)."""
    add_stream(urls, name, subjects, **config)
    try:
        yield name
    finally:
        delete_stream(urls, name)


def messages(name: str, urls: Sequence[str] = (SHARED_URL,)) -> list[Any]:
    """Every message stream ``name`` holds, in order (each a nats-py RawStreamMsg). A read that
    times out is made again (a cluster's stream may be electing a leader after a fault)."""

    async def run() -> list[Any] | None:
        client = await _connect(urls)
        try:
            js = client.jetstream(timeout=5)
            state = (await js.stream_info(name)).state
            found = []
            for seq in range(state.first_seq, state.last_seq + 1):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    found.append(await js.get_msg(name, seq))
            return found
        except (TimeoutError, nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
            return None
        finally:
            await client.close()

    found: list[Any] = wait_until(f"stream {name} read whole", lambda: asyncio.run(run()), READY_TIMEOUT_S)
    return found


def held(name: str, urls: Sequence[str] = (SHARED_URL,)) -> collections.Counter[uuid.UUID]:
    """How many times stream ``name`` holds each job (by the job id of its body, as a consumer
    reads it: a copy stored under another ``Nats-Msg-Id`` counts too)."""
    return collections.Counter(
        uuid.UUID(json.loads(message.data)["job_id"]) for message in messages(name, urls)
    )


class Cluster:
    """Three JetStream servers clustered on free loopback ports, each with its own store."""

    SIZE = 3

    def __init__(self, directory: Path) -> None:
        self.binary = conftest.need_binary("nats-server", "nats-server")
        self.directory = directory
        self.client_ports = [faultload.free_port() for _ in range(self.SIZE)]
        self.route_ports = [faultload.free_port() for _ in range(self.SIZE)]
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * self.SIZE
        self.name = unique_name("DRAINC")

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{port}" for port in self.client_ports]

    def start(self, index: int) -> None:
        routes = ",".join(f"nats-route://127.0.0.1:{port}" for port in self.route_ports)
        store = self.directory / f"node{index}"
        store.mkdir(exist_ok=True)
        log = self.directory / f"node{index}.log"
        command = [self.binary, "-a", "127.0.0.1", "-p", str(self.client_ports[index]), "-n", f"n{index}"]
        command += ["-js", "-sd", str(store), "-l", str(log), "--cluster_name", self.name]
        command += ["--cluster", f"nats://127.0.0.1:{self.route_ports[index]}", "--routes", routes]
        quiet = subprocess.DEVNULL
        self.processes[index] = subprocess.Popen(command, stdout=quiet, stderr=quiet)
        wait_until(
            f"nats-server n{index} listening",
            lambda: conftest.port_open("127.0.0.1", self.client_ports[index]),
            READY_TIMEOUT_S,
        )

    def kill(self, index: int) -> None:
        """SIGKILL server ``index`` (by its PID) and reap it."""
        process = self.processes[index]
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(10)
        self.processes[index] = None

    def start_all(self) -> None:
        for index in range(self.SIZE):
            self.start(index)
        wait_until("the cluster's JetStream meta leader", self.jetstream_ready, READY_TIMEOUT_S, 0.5)

    def jetstream_ready(self) -> bool:
        async def run() -> bool:
            client = await _connect(self.urls)
            try:
                await client.jetstream().account_info()
                return True
            except (nats.errors.Error, nats.js.errors.Error):
                return False
            finally:
                await client.close()

        try:
            return asyncio.run(run())
        except (nats.errors.Error, OSError):
            return False

    def stop_all(self) -> None:
        for index in range(self.SIZE):
            process = self.processes[index]
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    self.kill(index)
            self.processes[index] = None


@contextlib.contextmanager
def cluster(directory: Path) -> Iterator[Cluster]:
    """A running 3-node cluster for the block, stopped (by PID) afterwards."""
    running = Cluster(directory)
    try:
        running.start_all()
        yield running
    finally:
        running.stop_all()
