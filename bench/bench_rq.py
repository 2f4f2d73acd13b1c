"""The RQ path: the drain's end-to-end rate against RQ's own ``enqueue_many``, in the same run.

    .venv/bin/python bench/bench_rq.py [--jobs 100000] [--runs 3] [--delay-ms 2] [--rss-jobs 1000000]
                                       [--profile] [--batch-size 500]

raw    RQ alone: ``Queue.enqueue_many([Queue.prepare_data(...)] * 500, pipeline=p); p.execute()``
       for the same jobs, no database.
drain  the same jobs COPYed into a fresh ``staged_jobs`` table, then ``drain run --once`` as a
       subprocess, timed from its start (interpreter start-up included) to its exit; the rate net
       of start-up subtracts the same command's time on an empty table.

Each run measures both; the ratio reported is the median of the runs' ratios (target >= 0.95).
``--delay-ms`` puts a delaying TCP proxy (``bench/delay_proxy.py``, its own process) between
*both* sides and Redis: each direction is delayed by that much, as ``tc netem`` on loopback would.
``--rss-jobs`` drains that many rows once more and samples the drain's resident memory as it goes
(peak = its ``VmHWM``; target <= 100 MB, flat). ``--profile`` drains a copy in-process under
cProfile. Uses a database of its own (dropped afterwards) and a Redis db index it claims with the
tests' marker key, and deletes only the keys it created.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import redis
import rq

from drain import backend, config
from drain.relay import loop as relay
from drain.store import session as store

try:
    from bench import benchkit
except ImportError:  # run as a file: this folder is on sys.path
    import benchkit  # type: ignore[no-redef]

BATCH = 500  # the drain's default batch_size; --batch-size changes the drain's
JOB_NAME = "app.tasks.send_email"
TARGET_RATIO = 1.2  # issue 35: drain / enqueue_many, also with +2 ms each way
TARGET_RSS_MB = 100
SAMPLE_S = 0.05
COPY_ROWS_PER_COMMIT = 100_000
HERE = Path(__file__).resolve().parent
COPY = "COPY staged_jobs (job_name, job_args, queue, job_id) FROM STDIN"


@dataclasses.dataclass
class Run:
    raw_rate: float
    drain_rate: float
    net_rate: float

    @property
    def ratio(self) -> float:
        return self.drain_rate / self.raw_rate

    @property
    def net_ratio(self) -> float:
        return self.net_rate / self.raw_rate

    def __str__(self) -> str:
        return (
            f"enqueue_many {self.raw_rate:,.0f} jobs/s, drain {self.drain_rate:,.0f} jobs/s (net of start-up "
            f"{self.net_rate:,.0f}), ratio {self.ratio:.2f} ({self.net_ratio:.2f} net)"
        )


@dataclasses.dataclass
class Memory:
    jobs: int
    peak_mb: float
    samples_mb: list[float]  # resident set at 10%, 30%, 50%, 70%, 90% of the run


def jobs(count: int) -> Iterator[tuple[str, list[object], str]]:
    for number in range(count):
        yield JOB_NAME, [f"user{number}@example.com", number], str(uuid.uuid4())


def bench_rq_alone(redis_url: str, queue_name: str, count: int) -> float:
    """Jobs per second of RQ's own batch enqueue (one MULTI/EXEC per 500 jobs)."""
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_url)
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
    client.close()
    return count / elapsed


def copy_in(dsn: str, queue_name: str, count: int) -> None:
    with psycopg.connect(dsn) as conn:
        for start in range(0, count, COPY_ROWS_PER_COMMIT):
            rows = min(COPY_ROWS_PER_COMMIT, count - start)
            with conn.cursor().copy(
                "COPY staged_jobs (job_name, job_args, queue, job_id) FROM STDIN"
            ) as copy:
                for name, args, job_id in jobs(rows):
                    copy.write_row((name, json.dumps(args), queue_name, job_id))
            conn.commit()
        conn.execute("ANALYZE staged_jobs")


def write_config(path: Path, dsn: str, redis_url: str, batch_size: int = BATCH) -> Path:
    path.write_text(
        f'dsn = {json.dumps(dsn)}\nbatch_size = {batch_size}\n\n[backends.default]\ntype = "rq"\n'
        f"url = {json.dumps(redis_url)}\nallowed_jobs = [{json.dumps(JOB_NAME)}]\n"
    )
    return path


def drain_subprocess(config_path: Path, count: int) -> tuple[float, list[tuple[float, int]], int]:
    """(seconds, [(elapsed, VmRSS kB)], VmHWM kB) of ``drain run --once`` as a child process."""
    drain = Path(sys.executable).parent / "drain"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAIN_")}
    command = [str(drain), "run", "--once", "--config", str(config_path), "--log-level", "WARNING"]
    started = time.perf_counter()
    done = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The drain's own memory (VmRSS/VmHWM after exec): getrusage would report this bench process,
    # which the child was a copy of until it exec'd.
    samples: list[tuple[float, int]] = []
    peak_kb = 0
    while done.poll() is None:
        status = proc_status(done.pid)
        peak_kb = max(peak_kb, status.get("VmHWM", 0))
        if "VmRSS" in status:
            samples.append((time.perf_counter() - started, status["VmRSS"]))
        time.sleep(SAMPLE_S)
    elapsed = time.perf_counter() - started
    stdout, stderr = done.communicate()
    if done.returncode != 0 or f"published {count}," not in stdout:
        raise SystemExit(f"bench: drain run --once failed ({done.returncode}): {stdout}{stderr}")
    return elapsed, samples, peak_kb


def proc_status(pid: int) -> dict[str, int]:
    found: dict[str, int] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(("VmHWM:", "VmRSS:")):
                found[line.split(":")[0]] = int(line.split()[1])
    return found


@contextlib.contextmanager
def delayed(redis_url: str, delay_ms: float) -> Iterator[str]:
    """``redis_url`` through a delaying proxy (its own process), or unchanged for 0 ms."""
    if not delay_ms:
        yield redis_url
        return
    rest = redis_url.split("://", 1)[1]
    hostport, _, db = rest.partition("/")
    proxy = subprocess.Popen(
        [sys.executable, str(HERE / "delay_proxy.py"), "--target", hostport, "--delay-ms", str(delay_ms)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stdout is not None
        port = int(proxy.stdout.readline())
        yield f"redis://127.0.0.1:{port}/{db}"
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)


def one_run(dsn: str, redis_url: str, client: redis.Redis[bytes], count: int, config_path: Path) -> Run:
    raw_queue, drain_queue = (f"bench-{side}-{uuid.uuid4().hex[:8]}" for side in ("raw", "drain"))
    raw_rate = bench_rq_alone(redis_url, raw_queue, count)
    benchkit.forget_rq_queue(client, raw_queue)
    startup_s, _, _ = drain_subprocess(config_path, 0)
    copy_in(dsn, drain_queue, count)
    seconds, _, _ = drain_subprocess(config_path, count)
    held = rq.Queue(drain_queue, connection=client).count
    benchkit.forget_rq_queue(client, drain_queue)
    if held != count:
        raise SystemExit(f"bench: RQ holds {held} of {count} drained jobs")
    return Run(raw_rate, count / seconds, count / max(seconds - startup_s, 1e-9))


def memory_run(dsn: str, client: redis.Redis[bytes], count: int, config_path: Path) -> Memory:
    queue = f"bench-rss-{uuid.uuid4().hex[:8]}"
    copy_in(dsn, queue, count)
    seconds, samples, peak_kb = drain_subprocess(config_path, count)
    benchkit.forget_rq_queue(client, queue)
    at = [next((kb for t, kb in samples if t >= seconds * q), 0) / 1024 for q in (0.1, 0.3, 0.5, 0.7, 0.9)]
    return Memory(count, peak_kb / 1024, at)


def profile_in_process(dsn: str, redis_url: str, count: int, top: int = 25) -> tuple[float, str]:
    """Drain ``count`` rows with Relay.drain_once under cProfile; return (jobs/s, report)."""
    settings = config.parse(
        {
            "dsn": dsn,
            "batch_size": BATCH,
            "backends": {"default": {"type": "rq", "url": redis_url, "allowed_jobs": [JOB_NAME]}},
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


@dataclasses.dataclass
class Results:
    runs: list[Run]
    delayed_runs: list[Run]
    memory: Memory | None
    delay_ms: float

    @staticmethod
    def median(runs: list[Run]) -> float | None:
        return statistics.median(run.ratio for run in runs) if runs else None


def measure(
    *,
    jobs_: int = 100_000,
    runs: int = 3,
    delay_ms: float = 0.0,
    delayed_runs: int = 0,
    rss_jobs: int = 0,
    batch_size: int = BATCH,
    pg: str = "postgresql://postgres@127.0.0.1:5432",
    redis_base: str = "redis://127.0.0.1:6379",
    profile: bool = False,
    out: Callable[[str], None] = print,
) -> Results:
    """Run the RQ benchmarks; each run prints one line as it ends."""
    dbname = f"drain_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{pg}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{dbname}"')
    dsn = f"{pg}/{dbname}"
    redis_url, client = benchkit.claim_redis_db(redis_base)
    results = Results([], [], None, delay_ms)
    try:
        db = store.Store(config.Settings(dsn=dsn))
        db.migrate()
        db.close()
        with tempfile.TemporaryDirectory() as tmp:
            config_path = write_config(Path(tmp) / "drain.toml", dsn, redis_url, batch_size)
            for number in range(runs):
                run = one_run(dsn, redis_url, client, jobs_, config_path)
                results.runs.append(run)
                out(f"rq run {number + 1}: {run}")
            if delay_ms and delayed_runs:
                with delayed(redis_url, delay_ms) as slow_url:
                    slow_config = write_config(Path(tmp) / "slow.toml", dsn, slow_url, batch_size)
                    for number in range(delayed_runs):
                        run = one_run(dsn, slow_url, client, jobs_, slow_config)
                        results.delayed_runs.append(run)
                        out(f"rq +{delay_ms:g} ms each way, run {number + 1}: {run}")
            if rss_jobs:
                results.memory = memory_run(dsn, client, rss_jobs, config_path)
                memory = results.memory
                samples = ", ".join(f"{mb:.0f}" for mb in memory.samples_mb)
                out(
                    f"rq memory over {rss_jobs:,} rows: peak {memory.peak_mb:.0f} MB; "
                    f"at 10/30/50/70/90%: {samples} MB"
                )
            if profile:
                copy_in(dsn, f"bench-profile-{uuid.uuid4().hex[:8]}", jobs_)
                rate, report = profile_in_process(dsn, redis_url, jobs_)
                out(f"\nin-process drain under cProfile: {rate:,.0f} jobs/s\n{report}")
    finally:
        for key in client.keys("rq:queue:bench-*"):
            benchkit.forget_rq_queue(client, key.decode().removeprefix("rq:queue:"))
        benchkit.release_redis_db(client)
        with psycopg.connect(f"{pg}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="also run through a delaying proxy")
    parser.add_argument("--rss-jobs", type=int, default=0, help="also sample the drain's memory over N rows")
    parser.add_argument("--pg", default=os.environ.get("BENCH_PG", "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--redis", default=os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379"))
    parser.add_argument("--profile", action="store_true", help="also profile an in-process drain")
    parser.add_argument("--batch-size", type=int, default=BATCH, help="the drain's batch_size")
    args = parser.parse_args()
    results = measure(
        jobs_=args.jobs,
        runs=args.runs,
        delay_ms=args.delay_ms,
        delayed_runs=args.runs if args.delay_ms else 0,
        rss_jobs=args.rss_jobs,
        batch_size=args.batch_size,
        pg=args.pg,
        redis_base=args.redis,
        profile=args.profile,
    )
    print(f"median ratio drain / enqueue_many: {Results.median(results.runs):.2f} (target >= {TARGET_RATIO})")
    if results.delayed_runs:
        print(f"median ratio through +{args.delay_ms:g} ms: {Results.median(results.delayed_runs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
