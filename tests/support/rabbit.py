"""RabbitMQ helpers for tests: uniquely named queues on the shared broker, reading messages back,
and a private ``rabbitmq-server`` node for the tests that kill or alarm a broker.

The private node runs in the foreground as a child process with ``RUNNING_UNDER_SYSTEMD`` set, so
the rabbitmq-server script ``exec``s the Erlang VM and the child's PID is the beam's PID: killing it
with SIGKILL kills exactly that broker. Everything it writes (mnesia, logs, config, the Erlang
cookie in its own HOME) lives in a temporary directory; it listens on free loopback ports only.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import psycopg

import drain
from drain import backend, config
from drain.relay import loop as relay
from tests import conftest
from tests.support import faultload
from tests.support.waiting import wait_until

SHARED_URL = conftest.AMQP_URL
RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
READY_TIMEOUT_S = 120.0
CALL_DEADLINE_S = 60.0
"""How long a helper's connection may live: pika's blocking calls wait for their answer without
a timeout of their own, and a call_later on the BlockingConnection runs only between calls."""


def need_rabbitmq() -> None:
    parts = pika.URLParameters(SHARED_URL)
    conftest.need_service("RabbitMQ", parts.host, parts.port)


def connect(url: str, deadline_s: float = CALL_DEADLINE_S) -> pika.BlockingConnection:
    """A BlockingConnection torn down ``deadline_s`` after it opened, so no call on it can wait
    for ever. An answer the broker sends under another name never arrives: RabbitMQ answers
    declare-ok for a name holding CR or LF with the stripped name, and pika waits for the other.
    The timer is on the connection's own I/O loop, which runs inside a blocked call too; it ends
    the stream as pika's blocked-connection timeout does, and the call raises."""
    parameters = pika.URLParameters(url)
    parameters.socket_timeout = min(deadline_s, 10.0)
    connection = pika.BlockingConnection(parameters)
    impl = connection._impl
    reason = pika.exceptions.AMQPConnectionError(f"test helper: no answer within {deadline_s} s")
    impl.ioloop.call_later(deadline_s, lambda: impl._terminate_stream(reason))
    return connection


def unique_name(prefix: str = "drain-test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def queues(url: str, *names: str, arguments: dict[str, Any] | None = None) -> Iterator[tuple[str, ...]]:
    """Declare durable queues for a test (with ``arguments``: ``x-queue-type``, ``x-max-length``,
    ...) and delete them (only them) afterwards, with the exchange of the same name that Celery on
    AMQP declares beside each queue it publishes to."""
    try:
        connection = connect(url)
        try:
            channel = connection.channel()
            for name in names:
                channel.queue_declare(name, durable=True, arguments=arguments)
        finally:
            with contextlib.suppress(Exception):
                connection.close()
        yield names
    finally:
        with contextlib.suppress(Exception):
            delete_queues(url, *names)
        for name in names:
            with contextlib.suppress(Exception):
                delete_exchange(url, name)


def delete_queues(url: str, *names: str) -> None:
    connection = connect(url)
    try:
        channel = connection.channel()
        for name in names:
            channel.queue_delete(name)
    finally:
        connection.close()


def delete_exchange(url: str, name: str) -> None:
    connection = connect(url)
    try:
        connection.channel().exchange_delete(name)
    finally:
        connection.close()


def take_all(url: str, queue: str) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Consume every message the queue holds now: ``message_id -> (properties, decoded body)``."""
    held: dict[str, tuple[Any, dict[str, Any]]] = {}
    connection = connect(url)
    try:
        channel = connection.channel()
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return held
            held[str(properties.message_id)] = (properties, json.loads(body))
    finally:
        connection.close()


def take_counts(url: str, queues_: tuple[str, ...], by: str = "message_id") -> collections.Counter[str]:
    """Consume every message these queues hold now: ``message_id -> copies`` (duplicates kept);
    ``by = "correlation_id"`` counts Celery's task ids."""
    held: collections.Counter[str] = collections.Counter()
    connection = connect(url)
    try:
        channel = connection.channel()
        for queue in queues_:
            while True:
                method, properties, _body = channel.basic_get(queue, auto_ack=True)
                if method is None:
                    break
                held[str(getattr(properties, by))] += 1
    finally:
        connection.close()
    return held


def named_url(url: str, connection_name: str) -> str:
    """``url`` with a client-provided connection name (pika reads ``client_properties`` from the
    query), so that the broker can tell the drain's connections from the others."""
    query = urllib.parse.urlencode({"client_properties": repr({"connection_name": connection_name})})
    return f"{url}?{query}"


def close_connections_named(connection_name: str, *, times: int, every_s: float) -> None:
    """Have the shared broker close the connections named ``connection_name``, as
    ``rabbitmqctl close_connection`` does (``connection.close`` 320 CONNECTION_FORCED), ``times``
    times every ``every_s``; return at once. One ``rabbitmqctl eval`` starts a process in the
    broker that does it: each rabbitmqctl call costs seconds, too slow to hit a drain under load
    one call per close. Other connections (other tests') are left alone."""
    ctl = conftest.need_binary("rabbitmqctl", "rabbitmq-server")
    assert re.fullmatch(r"[\w.-]+", connection_name), "a name the Erlang expression can hold as it is"
    closer = f"""
        Named = fun(P) ->
            Props = proplists:get_value(client_properties,
                                        rabbit_networking:connection_info(P, [client_properties]), []),
            lists:member({{<<"connection_name">>, longstr, <<"{connection_name}">>}}, Props)
        end,
        Close = fun Loop(0) -> ok;
                    Loop(N) -> timer:sleep({round(every_s * 1000)}),
                               [catch rabbit_networking:close_connection(P, "closed by a drain test")
                                || P <- rabbit_networking:connections(), (catch Named(P)) =:= true],
                               Loop(N - 1)
                end,
        spawn(fun() -> Close({times}) end),
        ok."""
    subprocess.run([ctl, "eval", closer], capture_output=True, timeout=120, check=True)


def sockets_to(port: int) -> int:
    """How many open descriptors of this process are TCP sockets connected to ``port`` on
    loopback (from /proc: a socket closed by its owner disappears here at once)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:[") and target[8:-1] in inodes:
                count += 1
    return count


class PrivateBroker:
    """One private RabbitMQ node in ``base``; start/kill/restart it by PID.

    ``cookie`` is its Erlang cookie (nodes of one cluster share it; default: a fresh one),
    ``node`` its name and ``config`` extra lines for its ``rabbitmq.conf``. The management and
    Prometheus plugins stay off (an empty enabled-plugins file): nothing listens but AMQP and
    Erlang distribution, each on a free loopback port.
    """

    def __init__(
        self, base: Path, *, cookie: str | None = None, node: str | None = None, config: str = ""
    ) -> None:
        self.base = base
        self.node = node or f"{unique_name('drain')}@localhost"
        self.port = faultload.free_port()
        self.dist_port = faultload.free_port()
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"
        self.process: subprocess.Popen[bytes] | None = None
        home = base / "home"
        home.mkdir(parents=True, exist_ok=True)
        cookie_file = home / ".erlang.cookie"
        cookie_file.write_text(cookie or uuid.uuid4().hex.upper())
        cookie_file.chmod(0o400)
        (base / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "loopback_users.guest = true\n"
            "vm_memory_high_watermark.relative = 0.4\n" + config
        )
        (base / "enabled_plugins").write_text("[].\n")
        (base / "rabbitmq-env.conf").write_text("")
        self.env = {
            **{key: value for key, value in os.environ.items() if not key.startswith(("RABBITMQ_", "ERL_"))},
            "HOME": str(home),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq.conf"),
            "RABBITMQ_CONF_ENV_FILE": str(base / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(base / "node.pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RUNNING_UNDER_SYSTEMD": "true",  # the script execs the VM: our child's PID is the beam's
        }

    @staticmethod
    def available() -> bool:
        return (RABBIT_BIN / "rabbitmq-server").exists() and shutil.which("erl") is not None

    def start(self) -> None:
        """Start the node (again, on the same data) and wait until AMQP answers."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the node's VM and return at once (``wait_ready`` waits for AMQP)."""
        log = (self.base / "console.log").open("ab")
        self.process = subprocess.Popen(
            [str(RABBIT_BIN / "rabbitmq-server")],
            env=self.env,
            cwd=self.base,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def wait_ready(self) -> None:
        wait_until(f"private RabbitMQ on port {self.port}", self.ready, READY_TIMEOUT_S, interval_s=0.5)

    def ready(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(f"private RabbitMQ exited; see {self.base / 'console.log'}")
        try:
            parameters = pika.URLParameters(self.url)
            parameters.socket_timeout = 2
            pika.BlockingConnection(parameters).close()
            return True
        except pika.exceptions.AMQPError:
            return False

    def kill(self) -> None:
        """SIGKILL the beam (no shutdown, no flush) and reap it."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)

    def stop(self) -> None:
        """Stop the node gracefully (SIGTERM), then by SIGKILL if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()

    def ctl(self, *args: str) -> str:
        """Run rabbitmqctl against this node and return its output."""
        result = subprocess.run(
            [str(RABBIT_BIN / "rabbitmqctl"), "-n", self.node, *args],
            env=self.env,
            capture_output=True,
            timeout=120,
            check=True,
        )
        return result.stdout.decode()

    def set_memory_watermark(self, fraction: float) -> None:
        self.ctl("set_vm_memory_high_watermark", str(fraction))


@contextlib.contextmanager
def private_broker(base: Path, *, config: str = "") -> Iterator[PrivateBroker]:
    """A started private node (``config``: extra ``rabbitmq.conf`` lines), stopped by PID at the end."""
    if not PrivateBroker.available():
        conftest.missing("the rabbitmq-server and erl binaries are not installed")
    broker = PrivateBroker(base, config=config)
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()


class PrivateCluster:
    """Private RabbitMQ nodes sharing one Erlang cookie, joined into one cluster.

    Each node has its own name, ports and data directory under ``base``; the Erlang port mapper
    (epmd) the first node starts is the machine's shared one, and is left running.
    """

    def __init__(self, base: Path, size: int = 3, *, config: str = "") -> None:
        cookie = uuid.uuid4().hex.upper()
        prefix = unique_name("drain")
        self.nodes = [
            PrivateBroker(base / f"node{n}", cookie=cookie, node=f"{prefix}-{n}@localhost", config=config)
            for n in range(1, size + 1)
        ]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self) -> None:
        """Boot every node at once, then join the others to the first (stop_app, join, start_app)."""
        for node in self.nodes:
            node.launch()
        for node in self.nodes:
            node.wait_ready()
        first = self.nodes[0].node
        for node in self.nodes[1:]:
            node.ctl("stop_app")
            node.ctl("join_cluster", first)
            node.ctl("start_app")
            node.wait_ready()

    def running(self) -> list[PrivateBroker]:
        return [node for node in self.nodes if node.process is not None and node.process.poll() is None]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def private_cluster(base: Path, size: int = 3, *, config: str = "") -> Iterator[PrivateCluster]:
    """A started private cluster of ``size`` nodes, every node stopped by PID at the end."""
    if not PrivateBroker.available():
        conftest.missing("the rabbitmq-server and erl binaries are not installed")
    cluster = PrivateCluster(base, size, config=config)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


# --- the drain side: stage rows, run a Relay in a thread -------------------------------------


def drain_settings(dsn: str, backend: str, options: dict[str, Any], **overrides: Any) -> config.Settings:
    """Settings for an in-process Relay with one RabbitMQ backend named ``backend``."""
    backends = {backend: config.BackendSettings(backend, "rabbitmq", 10, options)}
    fields: dict[str, Any] = {
        "dsn": dsn,
        "poll_max_s": 0.2,
        "standby_retry_s": 0.2,
        "retry_base_s": 0.05,
        "publish_timeout_s": 10.0,
        "backends": backends,
        **overrides,
    }
    return config.Settings(**fields)


def stage_jobs(
    dsn: str, count: int, queues_: tuple[str, ...], backend: str, *, commit: bool = True, per_txn: int = 1000
) -> set[str]:
    """Stage ``count`` jobs spread over ``queues_`` in transactions of ``per_txn``; return their ids."""
    ids: set[str] = set()
    with psycopg.connect(dsn) as conn:
        for start in range(0, count, per_txn):
            jobs = [
                drain.Job(
                    "app.tasks.record", args=[n, "x" * 150], queue=queues_[n % len(queues_)], backend=backend
                )
                for n in range(start, min(start + per_txn, count))
            ]
            ids.update(str(job_id) for job_id in drain.stage_many(conn, jobs))
            if commit:
                conn.commit()
            else:
                conn.rollback()
    return ids


def staged_count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
        return int(row[0]) if row else 0


@contextlib.contextmanager
def running_relay(
    settings: config.Settings, adapters: dict[str, backend.Adapter] | None = None
) -> Iterator[relay.Relay]:
    """A Relay leading in a background thread (on ``adapters``, else those the settings build);
    stopped (gracefully) and joined at the end."""
    if adapters is None:
        adapters = backend.build_adapters(settings.backends, settings.publish_timeout_s)
    the_relay = relay.Relay(settings, adapters)
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            the_relay.run(stop)
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="relay", daemon=True)
    thread.start()
    try:
        yield the_relay
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not thread.is_alive(), "the relay did not stop"
    if failure:
        raise failure[0]


class Consumer:
    """A real pika consumer with manual acks on its own thread; records message ids as they come."""

    def __init__(self, url: str, queues_: tuple[str, ...]) -> None:
        self.url = url
        self.queues = queues_
        self.received: list[str] = []
        self.mismatched: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="consumer", daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> Consumer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        try:
            connection = pika.BlockingConnection(pika.URLParameters(self.url))
            channel = connection.channel()
            channel.basic_qos(prefetch_count=500)

            def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
                message_id = str(properties.message_id)
                if json.loads(body)["job_id"] != message_id:
                    self.mismatched.append(message_id)
                self.received.append(message_id)
                ch.basic_ack(method.delivery_tag)

            for queue in self.queues:
                channel.basic_consume(queue, on_message)
            while not self._stop.is_set():
                connection.process_data_events(time_limit=0.2)
            connection.close()
        except BaseException as exc:
            self.error = exc


def ctl(*args: str) -> str:
    """``rabbitmqctl args...`` against the shared broker (a vhost or user of the test's own only)."""
    done = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise AssertionError(f"rabbitmqctl {args[0]} failed: {done.stderr.strip()[-500:]}")
    return done.stdout


@contextlib.contextmanager
def own_vhost() -> Iterator[tuple[str, str, str]]:
    """A vhost and a user of the test's own on the shared broker, the user allowed everything
    there: yields (its amqp URL, the vhost, the user); both deleted afterwards."""
    conftest.need_binary("rabbitmqctl", "rabbitmq-server")
    name = unique_name("drain-vhost")
    password = uuid.uuid4().hex
    parts = pika.URLParameters(SHARED_URL)
    ctl("add_vhost", name)
    try:
        ctl("add_user", name, password)
        try:
            allow(name, name, write=".*")
            yield f"amqp://{name}:{password}@{parts.host}:{parts.port}/{name}", name, name
        finally:
            ctl("delete_user", name)
    finally:
        ctl("delete_vhost", name)


def allow(vhost: str, user: str, *, write: str) -> None:
    """The user may configure and read everything in the vhost, and write what ``write`` matches
    (``"^$"``: nothing)."""
    ctl("set_permissions", "-p", vhost, user, ".*", write, ".*")
