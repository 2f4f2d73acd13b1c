"""The RQ path: the drain's end-to-end rate against RQ's own batch-enqueue rate, in one run.

    .venv/bin/python bench/bench_rq.py [--jobs 100000] [--profile]

(a) RQ alone: ``Queue.enqueue_many([Queue.prepare_data(...)] * 500, pipeline=p); p.execute()``
    for the same jobs, no database.
(b) The drain: the same jobs COPYed into a fresh ``staged_jobs`` table, then ``drain run --once``
    timed as a subprocess (its wall clock includes interpreter start-up; its peak RSS comes from
    ``getrusage(RUSAGE_CHILDREN)``).

Prints both rates, their ratio (target >= 0.85) and the drain's peak RSS. ``--profile`` also
drains a second copy in-process under cProfile and prints where the time goes. Uses a database
of its own (dropped afterwards) and a Redis db index it claims with a marker key; it deletes only
the keys it created.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import redis
import rq

from drain import backend, config, relay, store

BATCH = 500  # the drain's default batch_size; --batch-size changes the drain's
JOB_NAME = "app.tasks.send_email"
TARGET_RATIO = 0.85
CLAIM_KEY = "drain-test:claim"  # the same marker as the test fixture: the two never share an index


def claim_redis_db(base_url: str) -> tuple[str, redis.Redis[bytes]]:
    """A db index (1..15) nobody else is using right now, marked as ours."""
    for index in range(1, 16):
        client: redis.Redis[bytes] = redis.Redis.from_url(f"{base_url}/{index}")
        if client.set(CLAIM_KEY, str(os.getpid()), nx=True, ex=3600):
            return f"{base_url}/{index}", client
        client.close()
    raise SystemExit("bench: no free Redis db index")


def jobs(count: int) -> Iterator[tuple[str, list[object], str]]:
    for number in range(count):
        yield JOB_NAME, [f"user{number}@example.com", number], str(uuid.uuid4())


def bench_rq_alone(client: redis.Redis[bytes], queue_name: str, count: int) -> float:
    """Jobs per second of RQ's own batch enqueue (one MULTI/EXEC per 500 jobs)."""
    queue = rq.Queue(queue_name, connection=client)
    pending = list(jobs(count))
    started = time.perf_counter()
    for offset in range(0, count, BATCH):
        pipe = client.pipeline()
        datas = [
            rq.Queue.prepare_data(name, args=args, kwargs={}, job_id=job_id)
            for name, args, job_id in pending[offset : offset + BATCH]
        ]
        queue.enqueue_many(datas, pipeline=pipe)
        pipe.execute()
    elapsed = time.perf_counter() - started
    assert queue.count == count, (queue.count, count)
    return count / elapsed


def copy_in(dsn: str, queue_name: str, count: int) -> None:
    with psycopg.connect(dsn) as conn:
        with conn.cursor().copy("COPY staged_jobs (job_name, job_args, queue, job_id) FROM STDIN") as copy:
            for name, args, job_id in jobs(count):
                copy.write_row((name, json.dumps(args), queue_name, job_id))
        conn.execute("ANALYZE staged_jobs")


def write_config(path: Path, dsn: str, redis_url: str, batch_size: int = BATCH) -> Path:
    path.write_text(
        f'dsn = {json.dumps(dsn)}\nbatch_size = {batch_size}\n\n[backends.default]\ntype = "rq"\n'
        f'url = {json.dumps(redis_url)}\nallowed_jobs = ["app.tasks.*"]\n'
    )
    return path


def bench_drain_subprocess(config_path: Path, count: int) -> tuple[float, float, float]:
    """(jobs/s, seconds, peak RSS in MB) of ``drain run --once`` as a child process."""
    drain = Path(sys.executable).parent / "drain"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAIN_")}
    command = [str(drain), "run", "--once", "--config", str(config_path), "--log-level", "WARNING"]
    started = time.perf_counter()
    done = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The drain's own peak: VmHWM of its memory map after exec. getrusage's maxrss would report
    # this (large) bench process, which the child was a copy of until it exec'd.
    peak_kb = 0
    while done.poll() is None:
        peak_kb = max(peak_kb, vm_hwm_kb(done.pid))
        time.sleep(0.05)
    elapsed = time.perf_counter() - started
    stdout, stderr = done.communicate()
    if done.returncode != 0 or f"published {count}," not in stdout:
        raise SystemExit(f"bench: drain run --once failed ({done.returncode}): {stdout}{stderr}")
    return count / elapsed, elapsed, peak_kb / 1024


def vm_hwm_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def profile_in_process(dsn: str, redis_url: str, count: int, top: int = 25) -> tuple[float, str]:
    """Drain ``count`` rows with Relay.drain_once under cProfile; return (jobs/s, report)."""
    settings = config.parse(
        {
            "dsn": dsn,
            "batch_size": BATCH,
            "backends": {"default": {"type": "rq", "url": redis_url, "allowed_jobs": ["app.tasks.*"]}},
        }
    )
    relay_ = relay.Relay(settings, backend.build_adapters(settings.backends, settings.publish_timeout_s))
    assert relay_.leadership.try_acquire()
    profiler = cProfile.Profile()
    published = 0
    started = time.perf_counter()
    profiler.enable()
    while published < count:
        report = relay_.drain_once()
        if not report.selected:
            break
        published += report.published
    profiler.disable()
    elapsed = time.perf_counter() - started
    relay_.shutdown()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return published / elapsed, out.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--pg", default=os.environ.get("BENCH_PG", "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--redis", default=os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379"))
    parser.add_argument("--profile", action="store_true", help="also profile an in-process drain")
    parser.add_argument("--batch-size", type=int, default=BATCH, help="the drain's batch_size")
    args = parser.parse_args()
    count: int = args.jobs

    dbname = f"drain_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{args.pg}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{dbname}"')
    dsn = f"{args.pg}/{dbname}"
    redis_url, client = claim_redis_db(args.redis)
    before = set(client.keys("*"))
    try:
        db = store.Store(config.Settings(dsn=dsn))
        db.migrate()
        db.close()

        raw_rate = bench_rq_alone(client, f"bench-raw-{uuid.uuid4().hex[:8]}", count)

        drain_queue = f"bench-drain-{uuid.uuid4().hex[:8]}"
        with tempfile.TemporaryDirectory() as tmp:
            config_path = write_config(Path(tmp) / "drain.toml", dsn, redis_url, args.batch_size)
            _, startup_s, _ = bench_drain_subprocess(config_path, 0)
            copy_in(dsn, drain_queue, count)
            drain_rate, seconds, rss_mb = bench_drain_subprocess(config_path, count)
        net_rate = count / max(seconds - startup_s, 1e-9)
        assert rq.Queue(drain_queue, connection=client).count == count

        print(f"jobs                     {count}")
        print(f"RQ enqueue_many alone    {raw_rate:,.0f} jobs/s")
        print(f"drain run --once         {drain_rate:,.0f} jobs/s ({seconds:.1f}s incl. start-up)")
        print(f"  net of start-up        {net_rate:,.0f} jobs/s (start-up, connect, lock: {startup_s:.2f}s)")
        print(f"batch_size               {args.batch_size}")
        print(f"ratio                    {drain_rate / raw_rate:.2f} (target >= {TARGET_RATIO})")
        print(f"ratio net of start-up    {net_rate / raw_rate:.2f}")
        print(f"drain peak RSS           {rss_mb:.0f} MB")

        if args.profile:
            copy_in(dsn, drain_queue, count)
            rate, report = profile_in_process(dsn, redis_url, count)
            print(f"\nin-process drain under cProfile: {rate:,.0f} jobs/s\n{report}")
    finally:
        created = set(client.keys("*")) - before
        for offset in range(0, len(created), 1000):
            client.delete(*list(created)[offset : offset + 1000])
        client.delete(CLAIM_KEY)
        client.close()
        with psycopg.connect(f"{args.pg}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
