"""A held snapshot: what a long transaction elsewhere on the primary costs the drain (issue 35).

    .venv/bin/python bench/bench_xmin.py [--seconds 300] [--baseline-seconds 60] [--rate 2000]
        [--sample-every 0.1] [--explain] [--json FILE]

A PostgreSQL cluster of the bench's own (benchkit.PrivatePostgres, default settings: autovacuum
on, its naptime a minute), a fresh ``staged_jobs`` table, and a real ``drain run`` process with
the default settings forwarding to RQ on the local Redis (a claimed db index; the bench deletes
only the keys it made, as a worker would consume them). pgbench stages ``--rate`` jobs/s (4
clients, a Poisson schedule, one INSERT a transaction). Two windows, one after the other:

1. without a held snapshot, ``--baseline-seconds``;
2. with one: a separate session runs ``BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*)
   FROM staged_jobs`` (as ``pg_dump`` or a report would) and stays open for ``--seconds``, so
   no row the drain deletes meanwhile can be vacuumed, nor its index entries marked dead.

Every ``--sample-every`` seconds the backlog is sampled: the ids the table's identity handed out
less the jobs RQ holds (and those the bench consumed), so the sample costs a sequence read and an
LLEN, never a walk of the table a held snapshot bloats (at most one in-progress INSERT per client
counts as backlog). Each window reports the backlog's median, p99 and max, and the drain's CPU
(utime + stime, /proc/<pid>/stat) per job, from before pgbench starts until every row is on RQ.

Targets (issue 35): with the snapshot held, backlog max <= 300 rows (moonshot 100), and the
drain's CPU per job with the snapshot / without <= 1.

``--explain``: at the end of the held window, before the snapshot is released, the drain's batch
query (select_due, as the drain would send it) under EXPLAIN (ANALYZE, BUFFERS), rolled back:
where a select's time goes with the dead index entries in place.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import redis

from drain import config
from drain.store import reading, sql
from drain.store import session as store

try:
    from bench import benchkit
except ImportError:  # run as a file: this folder is on sys.path
    import benchkit  # type: ignore[no-redef]

CLIENTS = 4
RATE = 2000
SECONDS = 300.0  # the figure: one snapshot held 5 minutes
BASELINE_SECONDS = 60.0
SAMPLE_EVERY_S = 0.1
PURGE_EVERY = 10  # samples between two purges of the RQ queue (a worker consuming it)
TARGET_BACKLOG_MAX = 300
MOONSHOT_BACKLOG_MAX = 100
TARGET_CPU_RATIO = 1.0
JOB_NAME = "app.tasks.bench"
JOB_ARGS = '["user@example.com", 42]'
SCRIPT = (
    "BEGIN;\nINSERT INTO staged_jobs (job_name, job_args, queue) VALUES ('{name}', '{args}', '{queue}');\n"
    "COMMIT;\n"
)
FORWARD_TIMEOUT_S = 600.0


@dataclasses.dataclass
class Window:
    """One window's figures."""

    name: str
    seconds: float
    jobs: int = 0
    drain_cpu_s: float = 0.0
    samples: list[int] = dataclasses.field(default_factory=list)
    dead_tuples: int = 0
    load: tuple[float, float] = (0.0, 0.0)

    @property
    def cpu_us_per_job(self) -> float:
        return 1e6 * self.drain_cpu_s / max(self.jobs, 1)

    def backlog(self) -> dict[str, float]:
        values = self.samples or [0]
        return {
            "median": float(statistics.median(values)),
            "p99": float(benchkit.percentile([float(v) for v in values], 0.99)),
            "max": float(max(values)),
        }

    def line(self) -> str:
        b = self.backlog()
        return (
            f"{self.name}: {self.jobs:,} jobs in {self.seconds:.0f} s; backlog median {b['median']:.0f}, "
            f"p99 {b['p99']:.0f}, max {b['max']:.0f} rows ({len(self.samples):,} samples); drain CPU "
            f"{self.cpu_us_per_job:.1f} us/job; dead tuples at the end {self.dead_tuples:,}; "
            f"load {self.load[0]:.2f} -> {self.load[1]:.2f}"
        )


@dataclasses.dataclass
class Rig:
    cluster: benchkit.PrivatePostgres
    dbname: str
    redis_url: str
    redis: redis.Redis[bytes]
    tmp: Path

    def dsn(self) -> str:
        return self.cluster.dsn(self.dbname)

    def sql(self, statement: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            cursor = conn.execute(statement, params)  # type: ignore[arg-type]  # bench-built SQL
            return cursor.fetchall() if cursor.description else []


@contextlib.contextmanager
def rig() -> Iterator[Rig]:
    cluster = benchkit.PrivatePostgres(
        {"max_wal_size": "8GB", "checkpoint_timeout": "1h", "shared_preload_libraries": "pg_stat_statements"}
    )
    try:
        redis_url, client = benchkit.claim_redis_db(os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379"))
    except BaseException:
        cluster.close()
        raise
    try:
        dbname = "drain_bench_xmin"
        with psycopg.connect(cluster.dsn(), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{dbname}"')
        with psycopg.connect(cluster.dsn(dbname), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")
        db = store.Store(config.Settings(dsn=cluster.dsn(dbname)))
        db.migrate()
        db.close()
        with tempfile.TemporaryDirectory(prefix="drain-bench-xmin-") as tmp:
            yield Rig(cluster, dbname, redis_url, client, Path(tmp))
    finally:
        for key in client.keys("rq:queue:bench-xmin-*"):
            benchkit.forget_rq_queue(client, key.decode().removeprefix("rq:queue:"))
        benchkit.release_redis_db(client)
        cluster.close()


@contextlib.contextmanager
def drain(the_rig: Rig) -> Iterator[subprocess.Popen[bytes]]:
    """A ``drain run`` process (default settings, RQ), leading and asleep when this yields."""
    backend = {"type": "rq", "url": the_rig.redis_url, "allowed_jobs": [JOB_NAME]}
    path = benchkit.write_config(the_rig.tmp / "drain.toml", the_rig.dsn(), backend)
    log = the_rig.tmp / "drain.log"
    with benchkit.drain_process(path, log) as process:

        def asleep() -> bool:
            if process.poll() is not None:
                raise SystemExit(f"bench: the drain exited ({process.returncode}): {log.read_text()[-2000:]}")
            return benchkit.wake_lock_held(the_rig.dsn())

        benchkit.wait_for(asleep, 30, "the drain to lead and sleep")
        yield process


class Sampler(threading.Thread):
    """Samples the backlog (ids handed out less jobs on RQ) every ``every`` seconds while
    ``sampling`` is set, and consumes the RQ queue as a worker would."""

    def __init__(self, the_rig: Rig, queue: str, every: float) -> None:
        super().__init__(daemon=True)
        self.rig, self.queue, self.every = the_rig, queue, every
        self.stop = threading.Event()
        self.sampling = threading.Event()
        self.samples: list[int] = []
        self.consumed = 0
        self.published = 0
        self.handed_out = 0
        self.base: int | None = None  # ids handed out before the window (the table is empty then)
        self._client: redis.Redis[bytes] = redis.Redis.from_url(the_rig.redis_url)

    def run(self) -> None:
        with psycopg.connect(self.rig.dsn(), autocommit=True) as conn:
            count = 0
            while not self.stop.wait(self.every):
                count += 1
                if count % PURGE_EVERY == 0:
                    self.consumed += benchkit.forget_rq_queue(self._client, self.queue, keep_queue=True)
                self.published = self.consumed + int(self._client.llen(f"rq:queue:{self.queue}"))
                row = conn.execute(
                    "SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('staged_jobs', 'id')), 0)"
                ).fetchone()
                assert row is not None
                if self.base is None:
                    self.base = int(row[0])
                self.handed_out = int(row[0]) - self.base
                if self.sampling.is_set():
                    self.samples.append(max(self.handed_out - self.published, 0))

    def close(self) -> None:
        self.stop.set()
        self.join()
        self.consumed += benchkit.forget_rq_queue(self._client, self.queue)
        self._client.close()


def pgbench(the_rig: Rig, queue: str, seconds: float, rate: float) -> int:
    """pgbench at ``rate`` transactions/s for ``seconds``; the transactions it committed."""
    script = the_rig.tmp / "stage.sql"
    script.write_text(SCRIPT.format(name=JOB_NAME, args=JOB_ARGS, queue=queue))
    command = [str(benchkit.PG_BIN / "pgbench"), "-n", "-h", "127.0.0.1", "-p", str(the_rig.cluster.port)]
    command += ["-U", "postgres", "-c", str(CLIENTS), "-j", "1", "-M", "prepared", "-f", str(script)]
    command += ["-T", str(max(1, round(seconds))), "-R", f"{rate:g}", the_rig.dbname]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("number of transactions actually processed:"):
            return int(line.split(":")[1].split("/")[0])
    raise SystemExit(f"bench: pgbench failed ({done.returncode}): {done.stderr.strip()[-500:]}")


def window(
    the_rig: Rig, process: subprocess.Popen[bytes], name: str, seconds: float, args: argparse.Namespace
) -> Window:
    """pgbench for ``seconds`` with the drain forwarding; sampled until every row is on RQ."""
    queue = f"bench-xmin-{uuid.uuid4().hex[:6]}"
    measured = Window(name, seconds)
    sampler = Sampler(the_rig, queue, args.sample_every)
    sampler.start()
    benchkit.wait_for(lambda: sampler.base is not None, 30, "the first sample")
    load = os.getloadavg()[0]
    the_rig.sql("SELECT pg_stat_statements_reset()")
    cpu = benchkit.cpu_s(process.pid)
    sampler.sampling.set()
    try:
        measured.jobs = pgbench(the_rig, queue, seconds, args.rate)
        benchkit.wait_for(
            lambda: sampler.published >= measured.jobs, FORWARD_TIMEOUT_S, "the drain to forward every row"
        )
        sampler.sampling.clear()
        measured.drain_cpu_s = benchkit.cpu_s(process.pid) - cpu
        measured.samples = list(sampler.samples)
        if args.explain and name == "held":
            print(explain(the_rig), flush=True)
    finally:
        sampler.close()
    measured.load = (load, os.getloadavg()[0])
    measured.dead_tuples = int(
        the_rig.sql("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'staged_jobs'")[0][0]
    )
    print(measured.line(), flush=True)
    print(statement_times(the_rig), flush=True)
    return measured


def statement_times(the_rig: Rig, top: int = 8) -> str:
    """The drain's statements that took the most server time in the window (pg_stat_statements):
    calls, mean and max milliseconds, and shared buffers read or hit per call."""
    rows = the_rig.sql(
        "SELECT calls, total_exec_time, mean_exec_time, max_exec_time,"
        " (shared_blks_hit + shared_blks_read)::float8 / greatest(calls, 1),"
        " left(regexp_replace(query, '\\s+', ' ', 'g'), 70)"
        " FROM pg_stat_statements"
        " WHERE query NOT LIKE '%%pg_stat_statements%%' AND query NOT LIKE 'INSERT INTO staged_jobs%%'"
        " ORDER BY total_exec_time DESC LIMIT %s",
        (top,),
    )
    lines = ["  server time by statement (calls, total ms, mean ms, max ms, buffers/call, text):"]
    lines += [f"    {c:>7} {t:>9.0f} {m:>7.2f} {x:>8.1f} {b:>8.0f}  {q}" for c, t, m, x, b, q in rows]
    return "\n".join(lines)


def explain(the_rig: Rig) -> str:
    """The batch query as the drain sends it (a full batch), under EXPLAIN (ANALYZE, BUFFERS),
    rolled back: with its window and without."""
    names = sql.Names("public", "staged_jobs")
    statement = sql.positional("select_due", names)
    reader = reading.Reader(config.Settings(dsn=the_rig.dsn()).batch_max_bytes)
    out = []
    with psycopg.connect(the_rig.dsn()) as conn:
        cases = (("window", 1000), ("no window", None))
        for label, window_rows in cases:
            params: dict[str, Any] = {"paused": [], "exclude": "{}"}
            params.update(reader.params(500, reader.batch_max_bytes))
            params["window"] = window_rows
            with psycopg.RawCursor(conn) as cursor:
                cursor.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, SUMMARY ON) " + statement.text,
                    statement.params(params),
                )
                plan = "\n".join(str(row[0]) for row in cursor.fetchall())
            conn.rollback()
            out.append(f"select_due ({label}) under the held snapshot:\n{plan}")
    return "\n\n".join(out)


def figures(windows: dict[str, Window]) -> list[dict[str, Any]]:
    held, free = windows["held"], windows["free"]
    backlog_max = held.backlog()["max"]
    ratio = held.cpu_us_per_job / max(free.cpu_us_per_job, 1e-9)
    rate = held.jobs / max(held.seconds, 1)
    return [
        {
            "name": f"Held snapshot {held.seconds:.0f} s at {rate:,.0f} jobs/s: backlog max (rows)",
            "values": [backlog_max],
            "target": f"<= {TARGET_BACKLOG_MAX}",
            "met": backlog_max <= TARGET_BACKLOG_MAX,
        },
        {
            "name": "Held snapshot: backlog median, held (rows)",
            "values": [held.backlog()["median"]],
            "target": "reported",
            "met": None,
        },
        {
            "name": "Held snapshot: backlog median, none (rows)",
            "values": [free.backlog()["median"]],
            "target": "reported",
            "met": None,
        },
        {
            "name": "Held snapshot: backlog max, none (rows)",
            "values": [free.backlog()["max"]],
            "target": "reported",
            "met": None,
        },
        {
            "name": "Held snapshot: drain CPU per job, held / none",
            "values": [ratio],
            "target": f"<= {TARGET_CPU_RATIO:g}",
            "met": ratio <= TARGET_CPU_RATIO,
        },
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=SECONDS, help="how long the snapshot is held")
    parser.add_argument("--baseline-seconds", type=float, default=BASELINE_SECONDS, help="the window without")
    parser.add_argument("--rate", type=float, default=RATE, help="jobs/s staged (4 pgbench clients)")
    parser.add_argument("--sample-every", type=float, default=SAMPLE_EVERY_S, help="seconds between samples")
    parser.add_argument("--explain", action="store_true", help="EXPLAIN the batch query under the snapshot")
    parser.add_argument("--json", type=Path, help="write the figures and each window here")
    args = parser.parse_args(argv)

    windows: dict[str, Window] = {}
    with rig() as the_rig, drain(the_rig) as process:
        windows["free"] = window(the_rig, process, "free", args.baseline_seconds, args)
        the_rig.sql("VACUUM staged_jobs")
        with psycopg.connect(the_rig.dsn()) as held:
            held.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            held.execute("SELECT count(*) FROM staged_jobs").fetchone()  # the snapshot, held open
            windows["held"] = window(the_rig, process, "held", args.seconds, args)
            held.rollback()
    found = figures(windows)
    for f in found:
        values = " / ".join(f"{v:.2f}" for v in f["values"])
        print(f"{f['name']}: {values} (target {f['target']})")
    if args.json:
        document = {
            "figures": found,
            "windows": {
                key: {**dataclasses.asdict(w), "samples": None, "backlog": w.backlog()}
                for key, w in windows.items()
            },
        }
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
