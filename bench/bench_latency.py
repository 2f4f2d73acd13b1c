"""Latency from commit to broker, the producers' tax and the idle cost of the wake-up (issue 14).

    .venv/bin/python bench/bench_latency.py [--seconds 8] [--json results.jsonl]

One run of each, against `drain run` subprocesses with the default settings:

(a) Latency, commit → broker, per job, at 100 and 2,000 jobs/s offered (open loop, 4 stager
    connections, one job per autocommit INSERT: its own transaction in one round trip, so the
    load generator takes less of the 2 cores) to RQ and to RabbitMQ. The stager stamps each row
    with clock_timestamp() in its INSERT, the transaction's only statement (the database clock,
    just before COMMIT: the figure includes the commit itself). Arrival: RQ's ``enqueued_at`` in the
    job's Redis hash (written by the drain's enqueue, acknowledged with the MULTI/EXEC); RabbitMQ:
    a pika consumer stamps each delivery. Same machine, same clock. Target p50 ≤ 10 ms, p99 ≤ 50 ms.
(b) Producer tax: commits/s of 4 concurrent stager processes (single-row transactions, flat out)
    against ``staged_jobs`` while the drain runs and forwards to RQ, over the same stagers against
    a plain table (same columns and indexes, no trigger) with no drain. Target ≥ 0.95. Two
    reference rows: the trigger with no drain running, and the trigger while the drain is held
    asleep (every commit notifies: what a plain NOTIFY trigger costs).
(c) Idle cost of a leader and of a standby on an empty table: statements per second (counted by
    a small proxy in front of each drain: simple-protocol Query and extended-protocol Execute
    messages) and CPU (the drain process plus its Postgres backend, from /proc).

Needs PostgreSQL on 127.0.0.1:5432 (user postgres; --pg or BENCH_PG), Redis (--redis) and
RabbitMQ (--amqp). Uses a database of its own (dropped afterwards), a Redis db index claimed with
the tests' marker key (only its own keys are deleted), and uniquely named RabbitMQ queues (deleted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import pika
import psycopg
import redis

from drain import config
from drain.store import session as store

try:
    from bench import benchkit
except ImportError:  # run as a file: this folder is on sys.path
    import benchkit  # type: ignore[no-redef]

JOB_NAME = "app.tasks.bench"
STAGERS = 4
RATES = (100, 2000)
TARGET_P50_MS = 10.0
TARGET_P99_MS = 50.0
TARGET_TAX = 0.95  # was a target; issue 26 replaced it with bench_cost.py's commit latency at a fixed load
INSERT = (
    "INSERT INTO {table} (job_name, job_args, queue) VALUES (%s, '[]', %s) "
    "RETURNING job_id::text, extract(epoch FROM clock_timestamp())::float8"
)
ARRIVAL_TIMEOUT_S = 120.0
WAKEUP = os.environ.get("BENCH_WAKEUP", "notify")  # "poll": the same runs without the wake-up
TAX_BLOCKS = 3
IDLE_SETTLE_S = 3.0  # let the leader's idle backoff reach poll_max_s before counting


# --- helpers --------------------------------------------------------------------------------


# --- (a) latency ----------------------------------------------------------------------------


def _paced(
    dsn: str, queue: str, per_stager: float, seconds: float, start: float, offset: float
) -> dict[str, tuple[float, float]]:
    stamps: dict[str, tuple[float, float]] = {}
    # One transaction per job, in one round trip: the INSERT runs in autocommit mode, its own
    # transaction, committed before the reply (the load generator's own cost is kept low: it
    # shares the 2 cores with the drain and the broker).
    with psycopg.connect(dsn, autocommit=True) as conn:
        for n in range(int(per_stager * seconds)):
            pause = start + (n + offset) / per_stager - time.time()
            if pause > 0:
                time.sleep(pause)
            row = conn.execute(INSERT.format(table="staged_jobs"), (JOB_NAME, queue)).fetchone()
            assert row is not None
            stamps[row[0]] = (row[1], time.time())  # before COMMIT (database), after it (ours)
    return stamps


def paced_stagers(
    dsn: str, queue: str, rate: float, seconds: float
) -> tuple[dict[str, tuple[float, float]], float]:
    """Stage ``rate`` jobs/s for ``seconds`` (open loop) from STAGERS processes; return
    {job_id: (stamp before COMMIT, time after COMMIT)} and the rate achieved."""
    start = time.time() + 1.0
    with multiprocessing.get_context("fork").Pool(STAGERS) as pool:
        parts = pool.starmap(
            _paced, [(dsn, queue, rate / STAGERS, seconds, start, n / STAGERS) for n in range(STAGERS)]
        )
    ended = time.time()
    stamps = {job_id: stamp for part in parts for job_id, stamp in part.items()}
    return stamps, len(stamps) / (ended - start)


def rq_arrivals(redis_url: str, job_ids: list[str]) -> dict[str, float]:
    client = redis.Redis.from_url(redis_url)
    found: dict[str, float] = {}
    try:
        pipe = client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(f"rq:job:{job_id}", "enqueued_at")
        for job_id, value in zip(job_ids, pipe.execute(), strict=True):
            if value:
                text = value.decode().rstrip("Z")
                found[job_id] = datetime.fromisoformat(text + "+00:00").timestamp()
    finally:
        client.close()
    return found


class RabbitConsumer(threading.Thread):
    """Stamps each delivery's arrival by its message_id (the job id)."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.url, self.queue = url, queue
        self.arrivals: dict[str, float] = {}
        self.ready = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(self.url))
        channel = connection.channel()
        channel.queue_declare(self.queue, durable=True)

        def on_message(_ch: Any, _method: Any, properties: Any, _body: bytes) -> None:
            self.arrivals[str(properties.message_id)] = time.time()

        channel.basic_consume(self.queue, on_message, auto_ack=True)
        self.ready.set()
        while not self.stop.is_set():
            connection.process_data_events(time_limit=0.05)
        channel.queue_delete(self.queue)
        connection.close()


def latency_run(
    dsn: str, tmp: Path, backend: str, rate: int, seconds: float, redis_url: str, amqp_url: str
) -> dict[str, Any]:
    queue = f"bench-latency-{uuid.uuid4().hex[:8]}"
    consumer: RabbitConsumer | None = None
    if backend == "rq":
        section: dict[str, Any] = {"type": "rq", "url": redis_url, "allowed_jobs": [JOB_NAME]}
    else:
        section = {"type": "rabbitmq", "url": amqp_url, "declare": True, "queues": [queue]}
        consumer = RabbitConsumer(amqp_url, queue)
        consumer.start()
        consumer.ready.wait(30)
    path = benchkit.write_config(tmp / f"latency-{backend}-{rate}.toml", dsn, section, wakeup=WAKEUP)
    with benchkit.drain_process(path, tmp / f"latency-{backend}-{rate}.log"):
        if WAKEUP == "notify":
            benchkit.wait_for(lambda: benchkit.wake_lock_held(dsn), 30, "the drain to lead and sleep")
        else:
            time.sleep(3)
        stamps, achieved = paced_stagers(dsn, queue, rate, seconds)
        ids = list(stamps)
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        while True:
            arrivals = rq_arrivals(redis_url, ids) if consumer is None else dict(consumer.arrivals)
            if len(arrivals) >= len(ids) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    if consumer is not None:
        consumer.stop.set()
        consumer.join(30)
    else:
        client = redis.Redis.from_url(redis_url)
        client.delete(*[f"rq:job:{job_id}" for job_id in ids], f"rq:queue:{queue}")
        client.srem("rq:queues", f"rq:queue:{queue}")
        client.close()
    latencies = [(arrivals[i] - stamps[i][0]) * 1000 for i in ids if i in arrivals]
    commits = [(stamps[i][1] - stamps[i][0]) * 1000 for i in ids]
    return {
        "backend": backend,
        "rate": rate,
        "achieved": achieved,
        "jobs": len(ids),
        "arrived": len(latencies),
        "p50_ms": benchkit.percentile(latencies, 0.50) if latencies else float("nan"),
        "p99_ms": benchkit.percentile(latencies, 0.99) if latencies else float("nan"),
        "max_ms": max(latencies) if latencies else float("nan"),
        "commit_p50_ms": benchkit.percentile(commits, 0.50),
        "commit_p99_ms": benchkit.percentile(commits, 0.99),
    }


# --- (b) producer tax -----------------------------------------------------------------------


def _flat_out(dsn: str, table: str, start: float, seconds: float, counts: Any, slot: int) -> None:
    with psycopg.connect(dsn) as conn:
        statement = INSERT.format(table=table)
        while time.time() < start:
            time.sleep(0.001)
        end = start + seconds
        done = 0
        while time.time() < end:
            conn.execute(statement, (JOB_NAME, "bench-tax"))
            conn.commit()
            done += 1
        counts[slot] = done


def commits_per_s(dsn: str, table: str, seconds: float) -> float:
    counts = multiprocessing.Array("q", STAGERS)
    start = time.time() + 1.0
    workers = [
        multiprocessing.Process(target=_flat_out, args=(dsn, table, start, seconds, counts, n))
        for n in range(STAGERS)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(counts) / seconds


def alternate(
    dsn: str, seconds: float, before_plain: Any = None, after_plain: Any = None
) -> tuple[float, float]:
    """Commits/s against plain_jobs and staged_jobs, in TAX_BLOCKS alternating blocks (so that
    load from elsewhere on a shared machine hits both alike)."""
    plain = staged_ = 0.0
    block_s = seconds / TAX_BLOCKS
    for _ in range(TAX_BLOCKS):
        if before_plain:
            before_plain()
        plain += commits_per_s(dsn, "plain_jobs", block_s) / TAX_BLOCKS
        if after_plain:
            after_plain()
        staged_ += commits_per_s(dsn, "staged_jobs", block_s) / TAX_BLOCKS
    return plain, staged_


def tax_run(dsn: str, tmp: Path, seconds: float, redis_url: str) -> dict[str, float]:
    """(1) The drain forwarding, against the plain table while the drain is paused (SIGSTOP: no
    CPU, no statements; plain_jobs has no trigger, so a lock it may hold changes nothing there);
    (2) the trigger with no drain; (3) every commit notifying (the bench holds the wake lock and
    a listener consumes the notifications)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE plain_jobs, staged_jobs")
    section = {"type": "rq", "url": redis_url, "allowed_jobs": [JOB_NAME]}
    path = benchkit.write_config(tmp / "tax.toml", dsn, section, wakeup=WAKEUP)
    with benchkit.drain_process(path, tmp / "tax.log") as process:
        time.sleep(3)  # leading, idle
        plain, forwarding = alternate(
            dsn,
            seconds,
            before_plain=lambda: os.kill(process.pid, signal.SIGSTOP),
            after_plain=lambda: os.kill(process.pid, signal.SIGCONT),
        )
        benchkit.wait_for(
            lambda: not staged(dsn), ARRIVAL_TIMEOUT_S, "the drain to forward the tax run's rows"
        )
    plain_2, trigger_only = alternate(dsn, seconds)
    sleeper = store.Store(config.Settings(dsn=dsn))
    try:
        armed, channel = sleeper.wake_arm()
        assert armed
        stop = threading.Event()

        def consume() -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f'LISTEN "{channel}"')
                while not stop.is_set():
                    for _ in conn.notifies(timeout=0.1):
                        pass

        listener = threading.Thread(target=consume)
        listener.start()
        plain_3, notifying = alternate(dsn, seconds)
        stop.set()
        listener.join()
    finally:
        sleeper.close()
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter("rq:job:*", count=10_000))
    for start in range(0, len(keys), 10_000):
        client.delete(*keys[start : start + 10_000])
    client.delete("rq:queue:bench-tax")
    client.srem("rq:queues", "rq:queue:bench-tax")
    client.close()
    return {
        "plain": plain,
        "forwarding": forwarding,
        "ratio": forwarding / plain,
        "plain_2": plain_2,
        "trigger_only": trigger_only,
        "trigger_only_ratio": trigger_only / plain_2,
        "plain_3": plain_3,
        "notify_every_commit": notifying,
        "notify_every_commit_ratio": notifying / plain_3,
    }


def staged(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    return int(row[0]) if row else 0


# --- (c) idle cost --------------------------------------------------------------------------


def backend_pids(dsn: str, name: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (name,)
        ).fetchall()
    return [int(row[0]) for row in rows]


def idle_run(dsn: str, tmp: Path, seconds: float, redis_url: str, pg: tuple[str, int]) -> dict[str, float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE staged_jobs")
    figures: dict[str, float] = {}
    proxies = {role: benchkit.CountingProxy(pg) for role in ("leader", "standby")}
    section = {"type": "rq", "url": redis_url, "allowed_jobs": [JOB_NAME]}
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with contextlib.ExitStack() as stack:
        processes: dict[str, subprocess.Popen[bytes]] = {}
        for role, proxy in proxies.items():
            proxy.start()
            stack.callback(proxy.close)
            proxied = (
                f"host=127.0.0.1 port={proxy.port} user=postgres dbname={dbname} "
                f"sslmode=disable gssencmode=disable application_name=bench-{role}"
            )
            path = benchkit.write_config(tmp / f"idle-{role}.toml", proxied, section)
            processes[role] = stack.enter_context(benchkit.drain_process(path, tmp / f"idle-{role}.log"))
            if role == "leader":
                benchkit.wait_for(lambda: benchkit.wake_lock_held(dsn), 30, "the leader to sleep")
        benchkit.wait_for(lambda: backend_pids(dsn, "bench-standby"), 30, "the standby to connect")
        time.sleep(IDLE_SETTLE_S)
        before = {}
        for role, process in processes.items():
            pids = [process.pid, *backend_pids(dsn, f"bench-{role}")]
            before[role] = (pids, sum(benchkit.cpu_s(pid) for pid in pids), proxies[role].statements)
        started = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - started
        for role, (pids, cpu_before, statements_before) in before.items():
            cpu_after = sum(benchkit.cpu_s(pid) for pid in pids if Path(f"/proc/{pid}").exists())
            figures[f"{role}_qps"] = (proxies[role].statements - statements_before) / elapsed
            figures[f"{role}_cpu_pct"] = 100 * (cpu_after - cpu_before) / elapsed
    return figures


# --- main -----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg", default=os.environ.get("BENCH_PG", "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--redis", default=os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379"))
    parser.add_argument(
        "--amqp", default=os.environ.get("BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672/%2F")
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each latency and tax run")
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--json", type=Path, help="append the figures as one JSON line")
    parser.add_argument("--backends", default="rq,rabbitmq")
    parser.add_argument("--rates", default=",".join(map(str, RATES)))
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: tax, idle")
    args = parser.parse_args()

    load_before = os.getloadavg()
    dbname = f"drain_bench_latency_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{args.pg}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{dbname}"')
    dsn = f"{args.pg}/{dbname}"
    redis_url, claim = benchkit.claim_redis_db(args.redis)
    pg_parts = psycopg.conninfo.conninfo_to_dict(args.pg)
    pg = (str(pg_parts.get("host", "127.0.0.1")), int(pg_parts.get("port", 5432)))
    results: dict[str, Any] = {}
    try:
        for table in ("staged_jobs", "plain_jobs"):
            db = store.Store(config.Settings(dsn=dsn, table=table))
            db.migrate()
            db.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP TRIGGER drain_wake ON plain_jobs")  # the plain table: no trigger
        with tempfile.TemporaryDirectory() as tmp:
            results["latency"] = [
                latency_run(dsn, Path(tmp), backend, int(rate), args.seconds, redis_url, args.amqp)
                for backend in filter(None, args.backends.split(","))
                for rate in filter(None, args.rates.split(","))
            ]
            if "tax" not in args.skip:
                results["tax"] = tax_run(dsn, Path(tmp), args.seconds, redis_url)
            if "idle" not in args.skip:
                results["idle"] = idle_run(dsn, Path(tmp), args.idle_seconds, redis_url, pg)
    finally:
        with psycopg.connect(f"{args.pg}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        benchkit.release_redis_db(claim)
    results["load"] = {"before": load_before, "after": os.getloadavg()}
    print_table(results)
    if args.json:
        with args.json.open("a") as out:
            out.write(json.dumps(results) + "\n")
    return 0


def print_table(results: dict[str, Any]) -> None:
    print(f"latency, commit → broker (target p50 ≤ {TARGET_P50_MS:.0f} ms, p99 ≤ {TARGET_P99_MS:.0f} ms)")
    print("  commit: the producer's own COMMIT (stamp to COMMIT returned), part of p50/p99")
    header = (
        "backend",
        "offered/s",
        "achieved/s",
        "jobs",
        "arrived",
        "p50 ms",
        "p99 ms",
        "max ms",
        "commit p50/p99",
    )
    print("{:<10}{:>10}{:>11}{:>7}{:>8}{:>9}{:>9}{:>9}{:>16}".format(*header))
    for row in results["latency"]:
        print(
            f"{row['backend']:<10}{row['rate']:>10}{row['achieved']:>11.0f}{row['jobs']:>7}{row['arrived']:>8}"
            f"{row['p50_ms']:>9.1f}{row['p99_ms']:>9.1f}{row['max_ms']:>9.1f}"
            f"{row['commit_p50_ms']:>9.1f}/{row['commit_p99_ms']:.1f}"
        )
    tax = results.get("tax")
    if tax is not None:
        print(
            f"\nproducer tax: {STAGERS} stager processes, single-row commits/s, flat out (contention on "
            f"shared cores; no longer a target, see bench_cost.py)"
        )
        rows = [
            ("(a) plain table (drain paused)", tax["plain"], None),
            ("    staged_jobs, drain forwarding", tax["forwarding"], tax["ratio"]),
            ("(b) plain table, no drain", tax["plain_2"], None),
            ("    staged_jobs, trigger, no drain", tax["trigger_only"], tax["trigger_only_ratio"]),
            ("(c) plain table", tax["plain_3"], None),
            (
                "    staged_jobs, every commit notifies",
                tax["notify_every_commit"],
                tax["notify_every_commit_ratio"],
            ),
        ]
        for label, rate, ratio in rows:
            print(f"  {label:<40}{rate:>8.0f}" + ("" if ratio is None else f"   ratio {ratio:.3f}"))
    idle = results.get("idle")
    if idle is not None:
        print("\nidle cost (empty table; CPU = the drain process + its Postgres backend)")
        for role in ("leader", "standby"):
            qps, cpu = idle[f"{role}_qps"], idle[f"{role}_cpu_pct"]
            print(f"  {role:<8} {qps:>6.1f} statements/s   CPU {cpu:.2f}%")
    before, after = results["load"]["before"][0], results["load"]["after"][0]
    print(f"\nload average before {before:.2f}, after {after:.2f} ({os.cpu_count()} cores)")


if __name__ == "__main__":
    raise SystemExit(main())
