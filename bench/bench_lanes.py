"""Lanes: how the rate of one table grows with its drains (issue 39), RQ backend.

    .venv/bin/python bench/bench_lanes.py [--rows 50000] [--runs 3] [--lanes 8] [--delay-ms 5]
        [--drains 4] [--plain-drains 2] [--plain-rows 50000] [--keyed] [--json FILE]

Each case starts N real ``drain run`` processes (``lanes = 8``, every other setting the default),
waits until they lead a fair share each (``pg_locks``: N members, every lane led, ⌈8/N⌉ or ⌊8/N⌋
each), then stages the backlog in one COPY transaction (unkeyed rows by default: a row's lane is
then its ``job_id``'s hash; ``--keyed``: each row its own ``ordering_key``) and waits until RQ
holds every job. The rate runs from the first job delivered to the last (RQ's ``enqueued_at`` in
each job's hash, written by the drain's enqueue): start-up, the balance and the COPY are outside
it. The drains' CPU is the sum of their utime + stime (/proc/<pid>/stat) from just before the
COPY until the last job arrived, over the jobs; their Postgres backends' CPU the same (the lane
holders' pids, read the same way).

1. With ``--delay-ms`` (5) each way to Redis *and* to Postgres: two delaying proxies
   (``delay_proxy.py``, each its own process) in front of the drains, the broker and the database
   in another zone. 1 drain, then ``--drains`` (4): figure rate(4) / rate(1), target >= 3; and
   CPU per job(4) / CPU per job(1), target <= 1.2.
2. Without delay: 1 drain and 2 drains (``--plain-drains``), rate(2) / rate(1), reported: on 2
   shared cores this measures contention for the cores.

Every case prints the machine's load average and its CPU busy share (/proc/stat, all cores)
over the case: where the cores bound the drains first, it shows there. The cases of a run take
turns; the figures are medians over ``--runs``. Uses a database of its own (dropped afterwards)
and a Redis db index it claims with the tests' marker key, and deletes only the keys it created.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import redis

from drain import config
from drain.relay import lanes as lanes_
from drain.store import session as store

try:
    from bench import benchkit
except ImportError:  # run as a file: this folder is on sys.path
    import benchkit  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
JOB_NAME = "app.tasks.send_email"
TARGET_SPEED_UP = 3.0  # issue 39: rate(4 drains) / rate(1), +5 ms each way to Redis and Postgres
TARGET_CPU = 1.2  # CPU per job(4 drains) / CPU per job(1)
COPY_ROWS = 100_000
BALANCE_TIMEOUT_S = 60.0
DELIVER_TIMEOUT_S = 600.0


@dataclasses.dataclass
class Case:
    """One configuration's run: N drains, a delay, what they did."""

    drains: int
    delay_ms: float
    rows: int
    seconds: float  # first to last delivered
    drain_cpu_s: float
    backend_cpu_s: float
    proxy_cpu_s: float
    busy: float  # the machine's CPU busy share over the case, all cores
    load: float

    @property
    def rate(self) -> float:
        return (self.rows - 1) / max(self.seconds, 1e-9)

    @property
    def cpu_us(self) -> float:
        return self.drain_cpu_s / self.rows * 1e6

    def __str__(self) -> str:
        cores = os.cpu_count() or 1
        return (
            f"{self.drains} drain{'s' if self.drains > 1 else ''}, +{self.delay_ms:g} ms: "
            f"{self.rate:,.0f} jobs/s ({self.rows:,} in {self.seconds:.2f} s); drain CPU "
            f"{self.cpu_us:.1f} us/job ({self.drain_cpu_s:.2f} s: each drain on a core "
            f"{self.drain_cpu_s / self.drains / max(self.seconds, 1e-9):.0%} of the time), backends "
            f"{self.backend_cpu_s / self.rows * 1e6:.1f} us/job, proxies {self.proxy_cpu_s:.2f} s; "
            f"machine busy {self.busy:.0%} of {cores} cores, load {self.load:.1f}"
        )


def rows_of(count: int, keyed: bool) -> Iterator[tuple[object, ...]]:
    for number in range(count):
        row: tuple[object, ...] = (JOB_NAME, json.dumps([f"user{number}@example.com", number]))
        yield (*row, str(uuid.uuid4()), *((f"key-{number}",) if keyed else ()))


def stage(dsn: str, queue: str, count: int, keyed: bool) -> None:
    """``count`` rows in one COPY transaction: every lane's rows become due at one commit."""
    columns = "job_name, job_args, job_id" + (", ordering_key" if keyed else "")
    with psycopg.connect(dsn) as conn:
        with conn.cursor().copy(f"COPY staged_jobs ({columns}, queue) FROM STDIN") as copy:
            for row in rows_of(count, keyed):
                copy.write_row((*row, queue))
        conn.commit()


def lane_holders(dsn: str, lanes: int) -> dict[int, int]:
    """Each member's backend pid: how many lanes it leads."""
    settings = config.Settings(dsn=dsn)
    space = lanes_.lane_space(settings.schema, settings.table)
    with psycopg.connect(dsn) as conn:
        found = conn.execute(
            "SELECT pid, objid, mode FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s::int::oid AND objsubid = 2"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (space,),
        ).fetchall()
    members = {pid: 0 for pid, lane, mode in found if lane >= lanes_.MEMBERS and mode == "ShareLock"}
    for pid, lane, mode in found:
        if lane < lanes_.MEMBERS and mode == "ExclusiveLock" and pid in members:
            members[pid] += 1
    return members


def balanced(dsn: str, lanes: int, drains: int) -> bool:
    members = lane_holders(dsn, lanes)
    counts = sorted(members.values())
    fair = {lanes // drains, -(-lanes // drains)}
    return len(members) == drains and sum(counts) == lanes and set(counts) <= fair


def delivered_span(client: redis.Redis[bytes], queue: str) -> tuple[int, float]:
    """(jobs in the queue, seconds from the first ``enqueued_at`` to the last)."""
    ids = client.lrange(f"rq:queue:{queue}", 0, -1)
    stamps: list[float] = []
    for start in range(0, len(ids), 10_000):
        pipe = client.pipeline(transaction=False)
        for job_id in ids[start : start + 10_000]:
            pipe.hget(b"rq:job:" + job_id, "enqueued_at")
        for value in pipe.execute():
            if value:
                stamps.append(datetime.fromisoformat(value.decode().rstrip("Z") + "+00:00").timestamp())
    return len(ids), (max(stamps) - min(stamps)) if stamps else 0.0


def busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of every core, from /proc/stat."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def process_cpu(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += benchkit.cpu_s(pid)
    return total


@contextlib.contextmanager
def delay_proxy(target: str, delay_ms: float) -> Iterator[tuple[int, int]]:
    """A delaying proxy in front of ``target`` (host:port): (its port, its pid)."""
    proxy = subprocess.Popen(
        [sys.executable, str(HERE / "delay_proxy.py"), "--target", target, "--delay-ms", str(delay_ms)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stdout is not None
        yield int(proxy.stdout.readline()), proxy.pid
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)


@dataclasses.dataclass(frozen=True)
class Wiring:
    """Where the drains connect (direct or through the proxies) and the proxies' pids."""

    dsn: str
    redis_url: str
    proxies: tuple[int, ...] = ()
    delay_ms: float = 0.0


def one_case(
    tmp: Path,
    wiring: Wiring,
    direct_dsn: str,
    client: redis.Redis[bytes],
    *,
    drains: int,
    rows: int,
    lanes: int,
    keyed: bool,
) -> Case:
    queue = f"bench-lanes-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute("VACUUM staged_jobs")  # the last case's dead rows (autovacuum is off for it)
    config_path = benchkit.write_config(
        tmp / f"drain-{drains}.toml",
        wiring.dsn,
        {"type": "rq", "url": wiring.redis_url, "allowed_jobs": [JOB_NAME]},
        lanes=lanes,
    )
    with contextlib.ExitStack() as stack:
        processes = [
            stack.enter_context(benchkit.drain_process(config_path, tmp / f"drain-{drains}-{index}.log"))
            for index in range(drains)
        ]
        benchkit.wait_for(
            lambda: balanced(direct_dsn, lanes, drains), BALANCE_TIMEOUT_S, f"{drains} drains to balance"
        )
        backends = list(lane_holders(direct_dsn, lanes))
        pids = [process.pid for process in processes]
        load = os.getloadavg()[0]
        cpu0, backend0, proxy0 = process_cpu(pids), process_cpu(backends), process_cpu(wiring.proxies)
        busy0 = busy_ticks()
        stage(direct_dsn, queue, rows, keyed)
        key = f"rq:queue:{queue}"
        benchkit.wait_for(lambda: client.llen(key) >= rows, DELIVER_TIMEOUT_S, f"{rows} jobs in RQ")
        busy1 = busy_ticks()
        cpu1, backend1, proxy1 = process_cpu(pids), process_cpu(backends), process_cpu(wiring.proxies)
        if any(process.poll() is not None for process in processes):
            raise SystemExit(f"bench: a drain exited; see its log in {tmp}")
    held, seconds = delivered_span(client, queue)
    benchkit.forget_rq_queue(client, queue)
    if held != rows:
        raise SystemExit(f"bench: RQ holds {held} of {rows} jobs")
    return Case(
        drains=drains,
        delay_ms=wiring.delay_ms,
        rows=rows,
        seconds=seconds,
        drain_cpu_s=cpu1 - cpu0,
        backend_cpu_s=backend1 - backend0,
        proxy_cpu_s=proxy1 - proxy0,
        busy=(busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1),
        load=load,
    )


@dataclasses.dataclass
class Results:
    delayed: list[tuple[Case, Case]] = dataclasses.field(default_factory=list)
    plain: list[tuple[Case, Case]] = dataclasses.field(default_factory=list)

    def figures(self) -> list[dict[str, Any]]:
        """The figures, each ``{name, values, target, met}`` (as bench/__main__.py's Figure)."""
        found: list[dict[str, Any]] = []
        if self.delayed:
            many = self.delayed[0][1].drains
            delay = self.delayed[0][0].delay_ms
            speed = [pair[1].rate / pair[0].rate for pair in self.delayed]
            cpu = [pair[1].cpu_us / pair[0].cpu_us for pair in self.delayed]
            found += [
                _figure(
                    f"Lanes, +{delay:g} ms: rate {many} drains / 1", speed, f">= {TARGET_SPEED_UP}", True
                ),
                _figure(f"Lanes, +{delay:g} ms: CPU/job {many} drains / 1", cpu, f"<= {TARGET_CPU}", False),
                _figure(f"Lanes, +{delay:g} ms: 1 drain (jobs/s)", [p[0].rate for p in self.delayed]),
                _figure(f"Lanes, +{delay:g} ms: {many} drains (jobs/s)", [p[1].rate for p in self.delayed]),
            ]
        if self.plain:
            many = self.plain[0][1].drains
            found += [
                _figure(
                    f"Lanes, no delay: rate {many} drains / 1", [p[1].rate / p[0].rate for p in self.plain]
                ),
                _figure("Lanes, no delay: 1 drain (jobs/s)", [p[0].rate for p in self.plain]),
                _figure(
                    f"Lanes, no delay: CPU/job {many} drains / 1",
                    [p[1].cpu_us / p[0].cpu_us for p in self.plain],
                ),
            ]
        return found


def _figure(
    name: str, values: list[float], target: str = "reported", higher: bool | None = None
) -> dict[str, Any]:
    median = statistics.median(values)
    met = None
    if higher is not None:
        bound = float(target.rsplit(maxsplit=1)[-1])
        met = median >= bound if higher else median <= bound
    return {"name": name, "values": values, "target": target, "met": met}


def measure(
    *,
    rows: int = 50_000,
    plain_rows: int = 50_000,
    runs: int = 3,
    lanes: int = 8,
    delay_ms: float = 5.0,
    drains: int = 4,
    plain_drains: int = 2,
    keyed: bool = False,
    pg: str = "postgresql://postgres@127.0.0.1:5432",
    redis_base: str = "redis://127.0.0.1:6379",
    out: Callable[[str], None] = print,
) -> Results:
    dbname = f"drain_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{pg}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{dbname}"')
    dsn = f"{pg}/{dbname}"
    redis_url, client = benchkit.claim_redis_db(redis_base)
    results = Results()
    pg_hostport = pg.split("://", 1)[1].rsplit("@", maxsplit=1)[-1].split("/", maxsplit=1)[0]
    redis_hostport, _, redis_db = redis_url.split("://", 1)[1].partition("/")
    try:
        db = store.Store(config.Settings(dsn=dsn, lanes=lanes))  # as the docs say: migrate with the lanes
        db.migrate()
        db.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("ALTER TABLE staged_jobs SET (autovacuum_enabled = off)")
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            plain = Wiring(dsn, redis_url)
            delayed = plain
            if delay_ms:
                pg_port, pg_pid = stack.enter_context(delay_proxy(pg_hostport, delay_ms))
                redis_port, redis_pid = stack.enter_context(delay_proxy(redis_hostport, delay_ms))
                user = pg.split("://", 1)[1].split("@", maxsplit=1)[0] if "@" in pg else "postgres"
                delayed = Wiring(
                    f"postgresql://{user}@127.0.0.1:{pg_port}/{dbname}?sslmode=disable",
                    f"redis://127.0.0.1:{redis_port}/{redis_db}",
                    (pg_pid, redis_pid),
                    delay_ms,
                )

            def pair(wiring: Wiring, many: int, count: int, number: int) -> tuple[Case, Case]:
                """1 drain and ``many``, taking turns on which goes first."""
                order = (1, many) if number % 2 else (many, 1)
                cases = [
                    one_case(Path(tmp), wiring, dsn, client, drains=n, rows=count, lanes=lanes, keyed=keyed)
                    for n in order
                ]
                one, several = sorted(cases, key=lambda case: case.drains)
                out(f"run {number}: {one}\nrun {number}: {several}")
                out(
                    f"run {number}: rate {many} / 1 = {several.rate / one.rate:.2f}, CPU per job "
                    f"{many} / 1 = {several.cpu_us / one.cpu_us:.2f}"
                )
                return one, several

            for number in range(1, runs + 1):
                if delay_ms:
                    results.delayed.append(pair(delayed, drains, rows, number))
                if plain_drains:
                    results.plain.append(pair(plain, plain_drains, plain_rows, number))
    finally:
        for key in client.keys("rq:queue:bench-lanes-*"):
            benchkit.forget_rq_queue(client, key.decode().removeprefix("rq:queue:"))
        benchkit.release_redis_db(client)
        with psycopg.connect(f"{pg}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50_000, help="the backlog of each delayed case")
    parser.add_argument("--plain-rows", type=int, default=50_000, help="the backlog without delay")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=5.0, help="each way, to Redis and to Postgres")
    parser.add_argument("--drains", type=int, default=4, help="against 1, with the delay")
    parser.add_argument("--plain-drains", type=int, default=2, help="against 1, without delay (0: skip)")
    parser.add_argument("--keyed", action="store_true", help="each row its own ordering_key")
    parser.add_argument("--pg", default=os.environ.get("BENCH_PG", "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--redis", default=os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379"))
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    print(f"load average before: {', '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    results = measure(
        rows=args.rows,
        plain_rows=args.plain_rows,
        runs=args.runs,
        lanes=args.lanes,
        delay_ms=args.delay_ms,
        drains=args.drains,
        plain_drains=args.plain_drains,
        keyed=args.keyed,
        pg=args.pg,
        redis_base=args.redis,
        out=lambda line: print(line, flush=True),
    )
    print(f"load average after: {', '.join(f'{v:.2f}' for v in os.getloadavg())}")
    figures = results.figures()
    for one in figures:
        values = " / ".join(f"{v:,.2f}" for v in one["values"])
        median = statistics.median(one["values"])
        print(f"{one['name']}: median {median:,.2f} ({values}); target {one['target']}")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
