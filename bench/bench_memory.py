"""The drain's memory while it drains a backlog of rows from 1 KB to 50 MB: flat, under the bound
the README states (``drain.store.reading.memory_bound_bytes``), whatever the rows hold.

    .venv/bin/python bench/bench_memory.py [--scale 1.0] [--batch-max-mib 64] [--backend rq]
                                           [--text ascii|unicode] [--quick]

The backlog is generated server-side with SQL (a few GB at ``--scale 1``) in a database of its
own (dropped afterwards), in random id order so every batch mixes sizes and shapes:

    1 KB   objects of a few fields            64 KB  arrays of small objects (a value every ~8 B)
    1 MB   arrays of integers                 8 MB   one long string (random hex)
    20 MB  one long string (repeated: Postgres stores it compressed, the drain must render it to
           size it)                           50 MB  the same

``--text unicode`` writes the same sizes in non-ASCII text (Latin-1, Greek, Cyrillic, CJK and
emoji: 2 to 4 bytes of UTF-8 a character, which every backend's JSON escapes to 6 or 12 bytes),
so that a row costs the most per byte of its text; ``--backend celery`` (Celery on Redis:
base64 in a JSON envelope) is the heaviest message.

Rows over a quarter of ``batch_max_bytes`` as text are dead-lettered unread (and non-ASCII rows
whose weight passes ``batch_max_bytes``); the others go to the backend (RQ by default) on the
local Redis (a db index the bench claims with the tests' marker key) or RabbitMQ, where a
consumer thread removes them as they arrive, so the broker never holds the backlog. ``drain run --once``
drains the table as a child process; its resident memory is sampled every 50 ms (VmRSS) and its
peak read from the kernel (VmHWM). The same command on an empty table gives the base. Prints
the peak, the samples at 10..90% of the run, the bound, and whether the peak is within it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pika
import psycopg
import redis

try:
    from bench import bench_rq, benchkit
except ImportError:  # run as a file: bench/ is on the path
    import bench_rq  # type: ignore[no-redef]
    import benchkit  # type: ignore[no-redef]
from drain import config
from drain.store import reading
from drain.store import session as store

MIB = 1 << 20
# (label, bytes of text per row, rows at --scale 1, SQL for job_args given the row number g)
SHAPES = (
    (
        "1 KB objects",
        1_000,
        20_000,
        "jsonb_build_array(jsonb_build_object("
        "'user', g, 'email', 'user' || g || '@example.com', 'note', repeat(md5(g::text), 25)))",
    ),
    (
        "64 KB arrays of objects",
        64_000,
        1_000,
        "(SELECT jsonb_agg(jsonb_build_object('i', i, 'v', i %% 7)) "
        "FROM generate_series(1, 4000 + g %% 2) AS i)",
    ),
    (
        "1 MB arrays of integers",
        1_000_000,
        200,
        "(SELECT jsonb_agg(i * 7919 %% 1000003) FROM generate_series(1, 125000 + g %% 2) AS i)",
    ),
    (
        "8 MB strings",
        8_000_000,
        60,
        "jsonb_build_array((SELECT string_agg(md5((g * 1000003 + i)::text), '') "
        "FROM generate_series(1, 250000) AS i))",
    ),
    ("20 MB repeated strings", 20_000_000, 40, "jsonb_build_array(repeat(md5(g::text), 625000))"),
    ("50 MB repeated strings", 50_000_000, 30, "jsonb_build_array(repeat(md5(g::text), 1562500))"),
)
# The hex digits as non-ASCII characters: 2 (Latin-1, Greek, Cyrillic), 3 (CJK) and 4 bytes
# (emoji) of UTF-8, escaped by every backend's JSON to 6 or 12 bytes (\uXXXX, a surrogate pair).
HEX_AS_UNICODE = "translate(%s, '0123456789abcdef', 'éàüßñøåçΩЖ中文字😀🎉ÿ')"
UNICODE_SHAPES = (
    (
        "1 KB objects, non-ASCII",
        1_000,
        20_000,
        "jsonb_build_array(jsonb_build_object('usuário', g, 'correo', 'usér' || g || '@exämple.com', "
        f"'nota', {HEX_AS_UNICODE % 'repeat(md5(g::text), 10)'}))",
    ),
    (
        "64 KB arrays of objects, non-ASCII",
        64_000,
        1_000,
        "(SELECT jsonb_agg(jsonb_build_object('ключ', i, 'v', 'é😀')) "
        "FROM generate_series(1, 2600 + g %% 2) AS i)",
    ),
    ("1 MB strings of é", 1_000_000, 200, "jsonb_build_array(repeat(chr(224 + g %% 30), 500000))"),
    (
        "8 MB strings, non-ASCII",
        8_000_000,
        60,
        "jsonb_build_array((SELECT string_agg("
        + HEX_AS_UNICODE % "md5((g * 1000003 + i)::text)"
        + ", '') FROM generate_series(1, 100000) AS i))",
    ),
    (
        "20 MB repeated strings, non-ASCII",
        20_000_000,
        40,
        f"jsonb_build_array(repeat({HEX_AS_UNICODE % 'md5(g::text)'}, 250000))",
    ),
    (
        "50 MB repeated strings, non-ASCII",
        50_000_000,
        30,
        f"jsonb_build_array(repeat({HEX_AS_UNICODE % 'md5(g::text)'}, 625000))",
    ),
)
TEXTS = {"ascii": SHAPES, "unicode": UNICODE_SHAPES}
JOB_NAME = "app.tasks.big"
SAMPLE_S = 0.05


@dataclasses.dataclass
class Result:
    rows: int
    text_bytes: int
    delivered: int
    dead: int
    base_mb: float
    peak_mb: float
    samples_mb: list[float]
    bound_mb: float
    seconds: float

    @property
    def met(self) -> bool:
        return self.peak_mb <= self.bound_mb


def stage_backlog(dsn: str, queue: str, scale: float, text: str = "ascii") -> tuple[int, int]:
    """Generate the backlog server-side, in random id order; return (rows, bytes of text)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE backlog (job_args jsonb, shuffle float8)")
        for _, _, count, expression in TEXTS[text]:
            rows = max(int(count * scale), 1)
            conn.execute(
                f"INSERT INTO backlog SELECT {expression}, random() FROM generate_series(1, %s) AS g",
                (rows,),
            )
        conn.execute(
            "INSERT INTO staged_jobs (job_name, job_args, queue) "
            "SELECT %s, job_args, %s FROM backlog ORDER BY shuffle",
            (JOB_NAME, queue),
        )
        conn.execute("VACUUM ANALYZE staged_jobs")
        row = conn.execute("SELECT count(*), sum(octet_length(job_args::text)) FROM staged_jobs").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


class Sink:
    """Where the drained jobs go, and a consumer thread that takes them away as they arrive (what
    workers would do), counting them: the broker never holds the backlog."""

    def __init__(self, kind: str, redis_url: str, client: redis.Redis[bytes], amqp_url: str) -> None:
        self.kind, self.redis_url, self.client, self.amqp_url = kind, redis_url, client, amqp_url
        self.queue = f"bench-memory-{uuid.uuid4().hex[:8]}"
        self.taken = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._consume, daemon=True)

    def backend(self) -> str:
        """The ``[backends.default]`` section's keys, as TOML lines."""
        if self.kind == "rq":
            return f'type = "rq"\nurl = "{self.redis_url}"\nallowed_jobs = ["{JOB_NAME}"]\n'
        if self.kind in ("celery", "celery-amqp"):
            broker = self.redis_url if self.kind == "celery" else self.amqp_url
            return f'type = "celery"\nbroker_url = "{broker}"\nallowed_jobs = ["{JOB_NAME}"]\n'
        return f'type = "rabbitmq"\nurl = "{self.amqp_url}"\n'

    def __enter__(self) -> Sink:
        if self.kind in ("rabbitmq", "celery-amqp"):
            connection = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
            connection.channel().queue_declare(self.queue, durable=True)
            connection.close()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self.kind == "rq":
            benchkit.forget_rq_queue(self.client, self.queue)
        elif self.kind == "celery":
            self.client.delete(self.queue)
        else:
            connection = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
            connection.channel().queue_delete(self.queue)
            connection.close()

    def drained(self) -> int:
        """Stop consuming; return how many jobs arrived."""
        self._stop.set()
        self._thread.join(timeout=30)
        self._take()
        return self.taken

    def _consume(self) -> None:
        while not self._stop.is_set():
            if not self._take():
                self._stop.wait(0.05)

    def _take(self) -> int:
        if self.kind in ("rabbitmq", "celery-amqp"):
            connection = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
            try:
                method = connection.channel().queue_purge(self.queue)
            finally:
                connection.close()
            taken = int(method.method.message_count)
        elif self.kind == "rq":
            key = f"rq:queue:{self.queue}"
            ids = self.client.lrange(key, 0, 99)
            if ids:
                self.client.delete(*(b"rq:job:" + job_id for job_id in ids))
                self.client.ltrim(key, len(ids), -1)
            taken = len(ids)
        else:
            pipe = self.client.pipeline()
            pipe.llen(self.queue)
            pipe.delete(self.queue)
            taken = int(pipe.execute()[0])
        self.taken += taken
        return taken


def run_drain(config_path: Path) -> tuple[float, list[tuple[float, int]], int]:
    """(seconds, [(elapsed, VmRSS kB)], VmHWM kB) of ``drain run --once``."""
    drain = Path(sys.executable).parent / "drain"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAIN_")}
    command = [str(drain), "run", "--once", "--config", str(config_path), "--log-level", "ERROR"]
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, int]] = []
    peak_kb = 0
    while child.poll() is None:
        status = bench_rq.proc_status(child.pid)
        peak_kb = max(peak_kb, status.get("VmHWM", 0))
        if "VmRSS" in status:
            samples.append((time.perf_counter() - started, status["VmRSS"]))
        time.sleep(SAMPLE_S)
    seconds = time.perf_counter() - started
    stdout, stderr = child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"bench: drain run --once failed ({child.returncode}): {stdout}{stderr}")
    return seconds, samples, peak_kb


def write_config(path: Path, dsn: str, sink: Sink, batch_max_bytes: int) -> Path:
    path.write_text(
        f'dsn = "{dsn}"\nbatch_max_bytes = {batch_max_bytes}\nmax_attempts = 1\n\n'
        f"[backends.default]\n{sink.backend()}"
    )
    return path


def measure(
    *,
    scale: float = 1.0,
    batch_max_bytes: int = config.BATCH_MAX_BYTES,
    backend: str = "rq",
    text: str = "ascii",
    pg: str = "postgresql://postgres@127.0.0.1:5432",
    redis_base: str = "redis://127.0.0.1:6379",
    amqp: str = "amqp://guest:guest@127.0.0.1:5672/%2F",
) -> Result:
    """Stage the backlog, drain it, and return the figures; prints a line when it is staged."""
    dbname = f"drain_bench_memory_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{pg}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{dbname}"')
    dsn = f"{pg}/{dbname}"
    redis_url, client = benchkit.claim_redis_db(redis_base)
    try:
        db = store.Store(config.Settings(dsn=dsn))
        db.migrate()
        db.close()
        with tempfile.TemporaryDirectory() as tmp, Sink(backend, redis_url, client, amqp) as sink:
            config_path = write_config(Path(tmp) / "drain.toml", dsn, sink, batch_max_bytes)
            _, _, base_kb = run_drain(config_path)  # an empty table: the drain's own footprint
            started = time.perf_counter()
            rows, text_bytes = stage_backlog(dsn, sink.queue, scale, text)
            print(
                f"memory: staged {rows:,} rows, {text_bytes / MIB:,.0f} MiB of JSON text, "
                f"in {time.perf_counter() - started:.0f} s",
                flush=True,
            )
            seconds, samples, peak_kb = run_drain(config_path)
            delivered = sink.drained()
        with psycopg.connect(dsn) as conn:
            counts = conn.execute(
                "SELECT (SELECT count(*) FROM staged_jobs_dead), (SELECT count(*) FROM staged_jobs)"
            ).fetchone()
        dead, left = counts if counts else (-1, -1)
        if left != 0 or delivered + dead != rows:
            raise SystemExit(f"bench: {rows} rows, {delivered} delivered, {dead} dead, {left} left")
    finally:
        benchkit.release_redis_db(client)
        with psycopg.connect(f"{pg}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
    at = [next((kb for t, kb in samples if t >= seconds * q), 0) / 1024 for q in (0.1, 0.3, 0.5, 0.7, 0.9)]
    bound = reading.memory_bound_bytes(batch_max_bytes, base_bytes=base_kb * 1024) / MIB
    return Result(rows, text_bytes, delivered, dead, base_kb / 1024, peak_kb / 1024, at, bound, seconds)


def report(result: Result) -> str:
    samples = ", ".join(f"{mb:.0f}" for mb in result.samples_mb)
    return (
        f"memory: {result.rows:,} rows ({result.text_bytes / MIB:,.0f} MiB of text) drained in "
        f"{result.seconds:.0f} s: {result.delivered:,} delivered, {result.dead:,} dead-lettered unread\n"
        f"memory: peak RSS {result.peak_mb:.0f} MB (base {result.base_mb:.0f} MB); "
        f"at 10/30/50/70/90%: {samples} MB; bound {result.bound_mb:.0f} MB: "
        f"{'within' if result.met else 'OVER'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="rows of each size, times this")
    parser.add_argument("--batch-max-mib", type=int, default=config.BATCH_MAX_BYTES // MIB)
    parser.add_argument("--backend", choices=("rq", "rabbitmq", "celery", "celery-amqp"), default="rq")
    parser.add_argument(
        "--text", choices=tuple(TEXTS), default="ascii", help="the rows' strings: ASCII, or non-ASCII"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: --scale 0.02")
    parser.add_argument(
        "--amqp", default=os.environ.get("BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672/%2F")
    )
    parser.add_argument("--pg", default=os.environ.get("BENCH_PG", "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--redis", default=os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379"))
    args = parser.parse_args()
    result = measure(
        scale=0.02 if args.quick else args.scale,
        batch_max_bytes=args.batch_max_mib * MIB,
        backend=args.backend,
        text=args.text,
        pg=args.pg,
        redis_base=args.redis,
        amqp=args.amqp,
    )
    print(report(result))
    return 0 if result.met else 1


if __name__ == "__main__":
    sys.exit(main())
