"""What the bench scripts share: a Redis db index of their own, the in-process "drain until empty"
loop, a ``drain run`` subprocess and its config, CPU seconds from /proc, a private PostgreSQL
cluster, and a proxy that counts what a client sends to Postgres.

The scripts run both as files (``python bench/bench_rq.py``: this folder is on ``sys.path``) and as
modules (``python -m bench``: the repository root is), so they import this module with::

    try:
        from bench import benchkit
    except ImportError:  # run as a file
        import benchkit
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import redis

import drain
from drain import backend, config
from drain.relay import loop as relay
from drain.store import connection

CLAIM_KEY = "drain-test:claim"  # the tests' redis_db fixture marks its index the same way
CLAIM_TTL_S = 3600
REDIS_DB_INDEXES = range(1, 16)  # db 0 is left to whoever uses Redis without choosing
DRAIN = str(Path(sys.executable).parent / "drain")
STOP_WAIT_S = 30
PG_BIN = Path(os.environ.get("DRAIN_TEST_PGBIN", "/usr/lib/postgresql/15/bin"))
POLL_S = 0.05


# --- Redis ----------------------------------------------------------------------------------


def claim_redis_db(base_url: str) -> tuple[str, redis.Redis[bytes]]:
    """A db index (1..15) nobody else is using right now, marked as ours: (its URL, a client).

    Give it back with :func:`release_redis_db`; the mark expires after an hour anyway."""
    for index in REDIS_DB_INDEXES:
        client: redis.Redis[bytes] = redis.Redis.from_url(f"{base_url}/{index}")
        if client.set(CLAIM_KEY, str(os.getpid()), nx=True, ex=CLAIM_TTL_S):
            return f"{base_url}/{index}", client
        client.close()
    raise SystemExit("bench: no free Redis db index")


def release_redis_db(client: redis.Redis[bytes]) -> None:
    client.delete(CLAIM_KEY)
    client.close()


def forget_rq_queue(client: redis.Redis[bytes], queue_name: str, *, keep_queue: bool = False) -> int:
    """Delete an RQ queue and the job hashes it lists (only the keys a bench created); return how
    many jobs it listed. ``keep_queue``: only empty it, as a worker would, while jobs keep coming
    (they are appended at the tail; this takes from the head)."""
    key = f"rq:queue:{queue_name}"
    deleted = 0
    while ids := client.lrange(key, 0, 9999):
        client.delete(*(b"rq:job:" + job_id for job_id in ids))
        client.ltrim(key, len(ids), -1)
        deleted += len(ids)
    if not keep_queue:
        client.delete(key)
        client.srem("rq:queues", key)
    return deleted


# --- the drain ------------------------------------------------------------------------------


def stage_rows(dsn: str, job_name: str, args: list[Any], queue: str, rows: int) -> None:
    """Stage ``rows`` jobs for the ``bench`` backend in one transaction (5,000 a statement), then
    VACUUM ANALYZE the table so the drain's plan sees them."""
    with psycopg.connect(dsn) as conn:
        for start in range(0, rows, 5000):
            jobs = [
                drain.Job(job_name, args=args, queue=queue, backend="bench")
                for _ in range(start, min(start + 5000, rows))
            ]
            drain.stage_many(conn, jobs)
        conn.commit()
        conn.autocommit = True
        conn.execute("VACUUM ANALYZE staged_jobs")


def timed_drain(
    settings: config.Settings, rows: int, warm_up: Callable[[relay.Relay], object] | None = None
) -> float:
    """Start a relay that leads ``settings``' table, run ``warm_up`` on it (untimed), and return the
    seconds its loop takes to forward the ``rows`` rows staged; exit if it forwards any other count."""
    adapters = backend.build_adapters(settings.backends, settings.publish_timeout_s)
    the_relay = relay.Relay(settings, adapters)
    try:
        assert the_relay.leadership.try_acquire()
        if warm_up is not None:
            warm_up(the_relay)
        started = time.perf_counter()
        forwarded = drain_until_empty(the_relay)
        elapsed = time.perf_counter() - started
    finally:
        the_relay.shutdown()
    if forwarded != rows:
        raise SystemExit(f"forwarded {forwarded} of {rows} rows")
    return elapsed


def drain_until_empty(the_relay: relay.Relay) -> int:
    """Run ``Relay.drain_step()`` (the pipelined loop of ``drain run``) until a step finds no row
    and nothing is in flight; return how many jobs were published. The relay must lead."""
    forwarded = 0
    while True:
        report = the_relay.drain_step()
        forwarded += report.published
        if not report.selected and not the_relay.in_flight:
            return forwarded


def write_config(path: Path, dsn: str, backend: Mapping[str, Any], **keys: Any) -> Path:
    """A drain config file: top-level ``keys`` and one backend named ``default``."""
    lines = [f"dsn = {json.dumps(dsn)}", *(f"{k} = {json.dumps(v)}" for k, v in keys.items())]
    lines += ["", "[backends.default]", *(f"{k} = {json.dumps(v)}" for k, v in backend.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def drain_process(config_path: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``drain run --config config_path`` as a child (output to ``log``), terminated on exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRAIN_", "PG"))}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [DRAIN, "run", "--config", str(config_path)], stdout=out, stderr=out, env=env
        )
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_split_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process (all its threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc/<pid>/stat."""
    return sum(cpu_split_s(pid))


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it is true; a one-line SystemExit after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: timed out waiting for {what}")
        time.sleep(POLL_S)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# --- a private PostgreSQL -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PrivatePostgres:
    """A cluster of the bench's own: initdb in a temp dir, a free loopback port, ``settings`` as
    ``-c`` options. As root the server runs as the ``postgres`` user (initdb refuses root).
    ``close()`` stops it (fast shutdown) and removes its files."""

    def __init__(self, settings: Mapping[str, str], bindir: Path = PG_BIN) -> None:
        self.bindir = bindir
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="drain-bench-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self._user: dict[str, Any] = {}
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._user = {"user": entry.pw_uid, "group": entry.pw_gid}
        try:
            self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")
            options = [f"-p {self.port}", "-c listen_addresses=127.0.0.1", f"-k {self.root}"]
            options += [f"-c {key}={value}" for key, value in settings.items()]
            self._run(
                "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", " ".join(options), "-w", "start"
            )
        except BaseException:
            self.close()
            raise

    def _run(self, program: str, *arguments: str) -> None:
        done = subprocess.run(
            [str(self.bindir / program), *arguments],
            capture_output=True,
            text=True,
            check=False,
            **self._user,
        )
        if done.returncode != 0:
            raise SystemExit(f"bench: {program} failed: {(done.stderr or done.stdout).strip()}")

    def dsn(self, dbname: str = "postgres", user: str = "postgres") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}"

    def close(self) -> None:
        if (self.data / "postmaster.pid").exists():
            subprocess.run(
                [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"],
                capture_output=True,
                check=False,
                **self._user,
            )
        shutil.rmtree(self.root, ignore_errors=True)


# --- the drain's side of the wire -----------------------------------------------------------


def wake_lock_held(dsn: str, table: str = "staged_jobs") -> bool:
    """Whether an idle leader sleeps on ``table``'s wake-up (it holds the wake lock)."""
    with psycopg.connect(dsn) as conn:
        key = conn.execute("SELECT hashtextextended(%s, 0)", (f"drain-wake:public.{table}",)).fetchone()
        assert key is not None
        classid, objid = connection.split_key(int(key[0]))
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND mode = 'ExclusiveLock' AND classid = %s AND objid = %s",
            (classid, objid),
        ).fetchone()
    return bool(row and row[0])


class _Exchange:
    """One proxied connection's direction of talk: a round trip ends when the server answers
    after the client said something."""

    def __init__(self) -> None:
        self.client_spoke = False


class CountingProxy(threading.Thread):
    """Forwards loopback connections to Postgres, counting what the clients send: statements
    (Query and Execute messages) and round trips (each time the server answers after the client
    sent something; requests sent together before the answer count once, as in pipeline mode;
    a notification the client did not ask for counts nothing). The client's DSN must disable
    SSL/GSS negotiation so the stream is plain protocol. Each round trip gets the proxy's own
    forwarding delay (a fraction of a millisecond): count with it, time without it."""

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(daemon=True)
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.statements = 0
        self.round_trips = 0
        self._lock = threading.Lock()

    def run(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            exchange = _Exchange()
            threading.Thread(target=self._from_client, args=(client, server, exchange), daemon=True).start()
            threading.Thread(target=self._from_server, args=(server, client, exchange), daemon=True).start()

    def _from_server(self, source: socket.socket, sink: socket.socket, exchange: _Exchange) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    if exchange.client_spoke:
                        exchange.client_spoke = False
                        self.round_trips += 1
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def _from_client(self, source: socket.socket, sink: socket.socket, exchange: _Exchange) -> None:
        buffer = b""
        started = False  # the first client message (startup) has no type byte
        try:
            while data := source.recv(65536):
                with self._lock:
                    exchange.client_spoke = True
                sink.sendall(data)
                buffer += data
                while True:
                    if not started:
                        if len(buffer) < 4:
                            break
                        (length,) = struct.unpack("!I", buffer[:4])
                        if len(buffer) < length:
                            break
                        buffer, started = buffer[length:], True
                        continue
                    if len(buffer) < 5:
                        break
                    kind = buffer[:1]
                    (length,) = struct.unpack("!I", buffer[1:5])
                    if len(buffer) < 1 + length:
                        break
                    if kind in (b"Q", b"E"):
                        with self._lock:
                            self.statements += 1
                    buffer = buffer[1 + length :]
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()
