"""The console's pages on a big table, and the drain's rate while an operator watches.

    .venv/bin/python bench/bench_console.py [--staged 1000000] [--dead 100000] [--rounds 3] [--fetches 20]

In a database of its own (dropped afterwards, unless ``--keep``): ``--staged`` rows (nine in ten
due, the rest due tomorrow; eight queues over three backends, one in ten with an ordering key)
and ``--dead`` dead letters (twenty job names, three error texts, keyword arguments holding a
user id; one died each second, numbered in that order as the drain numbers them), generated with
SQL and analyzed. A ``drain console`` process serves them.

- Pages: the overview, then a dead-letter page under each filter kind (job name, backend, queue,
  error text, ordering key, a value or a key in the arguments, time), with many matches and with
  few or none, then one dead letter: each fetched ``--fetches`` times (20) after one warm-up;
  the median and the worst, in ms, against the target (under 200 ms). The plan of the page's
  walk (dead_matching; dead_candidates under a text search: EXPLAIN ANALYZE) under three
  filters.
- The drain's rate: 50,000 due rows a round drained by the in-process relay through the in-memory
  backend (the database side alone, the strictest case), in phases of 10 batches, alternately
  with no one watching and with a client fetching the overview every 0.5 s (an open overview
  refreshes every 10 s: twenty operators watching), ``--rounds`` times. Prints both rates and
  their ratio (target >= 0.95).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

from drain import config, testing
from drain.console import figures
from drain.relay import loop as relay
from drain.store import admin, sql
from drain.store import session as store

try:
    from bench import benchkit
except ImportError:  # run as a file
    import benchkit  # type: ignore[no-redef]

TARGET_MS = 200.0
TARGET_RATIO = 0.95
FETCHES = 20
DRAINED = 50_000
WATCH_EVERY_S = 0.5  # the overview refreshes every 10 s: twenty operators watching (--watch-every)
PHASE_BATCHES = 10
PAGES = (  # (what, address): the overview, then each filter kind (pages() adds two)
    ("overview", "/"),
    ("dead letters, no filter", "/dead"),
    ("job name", "/dead?job_name=app.tasks.job7"),
    ("job name, none match", "/dead?job_name=app.tasks.nothing"),
    ("backend", "/dead?backend=b1"),
    ("queue", "/dead?queue=q3"),
    ("backend and queue", "/dead?backend=b1&queue=q3"),
    ("error text", "/dead?error=timeout"),
    ("error text, none match", "/dead?error=no+such+error"),
    ("ordering key", "/dead?ordering_key=key-77"),
    ("a value in the arguments (20 match)", "/dead?arg=4242"),
    ("a key in the arguments", "/dead?arg=user_id"),
    ("arguments, none match", "/dead?arg=no-such-value"),
    ("time and job name", "/dead?since=2026-01-01T00:00&job_name=app.tasks.job3"),
)


def pages(dead: int) -> list[tuple[str, str]]:
    """PAGES, a time filter of an hour that holds dead letters (3,600: one died each second), and
    one dead letter of the ``dead``."""
    since = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=3)
    until = since + datetime.timedelta(hours=1)
    window = f"/dead?since={since:%Y-%m-%dT%H:%M}&until={until:%Y-%m-%dT%H:%M}"
    return [*PAGES, ("time, an hour", window), ("one dead letter", f"/dead/{max(dead // 2, 1)}")]


def settings_for(dsn: str) -> config.Settings:
    return config.Settings(
        dsn=dsn,
        batch_size=500,
        pipeline_depth=0,
        backends={name: config.BackendSettings(name, "memory", 10, {}) for name in ("b0", "b1", "b2")},
    )


def populate(dsn: str, staged: int, dead: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (job_name, job_args, queue, backend, run_at, ordering_key) "
            "SELECT 'app.tasks.job' || (g %% 20), jsonb_build_array(g), 'q' || (g %% 8), 'b' || (g %% 3), "
            "CASE WHEN g %% 10 = 0 THEN now() + interval '1 day' END, "
            "CASE WHEN g %% 10 = 5 THEN 'key-' || (g %% 1000) END "
            "FROM generate_series(1, %s) AS g",
            (staged,),
        )
        conn.execute(
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id, "
            "options, created_at, attempts, error, dead_at, ordering_key) "
            "SELECT g, 'app.tasks.job' || (g %% 20), jsonb_build_array(g), "
            "jsonb_build_object('user_id', g, 'note', repeat('x', 100)), 'q' || (g %% 8), 'b' || (g %% 3), "
            "gen_random_uuid(), '{}', now() - interval '2 days', 5, "
            "(ARRAY['TimeoutError: the worker took too long', 'KeyError: ''customer''', "
            "'ConnectionRefusedError: [Errno 111]'])[g %% 3 + 1], "
            "now() - ((%s - g) || ' seconds')::interval, "
            "CASE WHEN g %% 10 = 7 THEN 'key-' || (g %% 1000) END "
            "FROM generate_series(1, %s) AS g",
            (dead, dead),
        )
        conn.execute("VACUUM ANALYZE staged_jobs")
        conn.execute("VACUUM ANALYZE staged_jobs_dead")


def fetch(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as response:
        response.read()
        assert response.status == 200, url
    return (time.perf_counter() - started) * 1000


def time_pages(base: str, fetches: int, dead: int) -> bool:
    """Fetch each page ``fetches`` times after a warm-up; print the median and the worst against
    TARGET_MS; whether every median met it."""
    met = True
    for what, page in pages(dead):
        fetch(base + page)
        times = [fetch(base + page) for _ in range(fetches)]
        median, worst = statistics.median(times), max(times)
        met = met and median < TARGET_MS
        verdict = "under" if median < TARGET_MS else "NOT under"
        print(
            f"  page {what:38} median {median:7.1f} ms   worst {worst:7.1f} ms   "
            f"({verdict} {TARGET_MS:.0f} ms)   {page}"
        )
    return met


def print_plans(dsn: str) -> None:
    """The plan of the page's walk (dead_matching, dead_candidates) under three filters, on a
    session set up as the console's (no JIT, its statement_timeout): the scans of the dead letters
    it ran, and its time."""
    names = sql.Names("public", "staged_jobs")
    cases = {
        "job name": admin.DeadFilter(job_name="app.tasks.job7", limit=100),
        "error text, none match": admin.DeadFilter(error="no such error", limit=100),
        "a value in the arguments": admin.DeadFilter(arg="4242", limit=100),
    }
    with psycopg.connect(dsn) as conn:
        admin.Admin(conn, names).limit_statements(5_000)
        for label, filters in cases.items():
            floor = None
            if filters.error or filters.arg:
                bound = {**filters.params(), "scan": figures.TEXT_SCAN_ROWS}
                found = conn.execute(sql.query("dead_scan_bound", names), bound).fetchone()
                floor = None if found is None else found[0]
            params: dict[str, Any] = {
                **filters.params(),
                "cap": figures.PAGE_COUNT_CAP,
                "scan": None,
                "floor": floor,
                "bytes": admin.CHECK_BYTES,
                "searching": True,
            }
            walk = "dead_candidates" if filters.error or filters.arg else "dead_matching"
            plan = conn.execute(
                b"EXPLAIN (ANALYZE, COSTS OFF) " + sql.query(walk, names).as_bytes(conn), params
            ).fetchall()
            lines = [row[0].strip().removeprefix("->  ") for row in plan]
            scans = [line for line in lines if " on staged_jobs_dead" in line and "never" not in line]
            print(f"  {label}: {'; '.join(scans)}; {lines[-1]}")


def drain_rates(dsn: str, watched: str, rows: int, every_s: float) -> tuple[float, float]:
    """Jobs per second (alone, watched) draining ``rows`` of the due rows (the oldest) in phases of
    PHASE_BATCHES batches, alternately with nobody watching and with a client fetching the
    overview every ``every_s``: a machine whose load drifts slows both alike."""
    watching = threading.Event()
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(every_s):
            if watching.is_set():
                fetch(watched + "/")

    memories = {name: testing.MemoryAdapter(name) for name in ("b0", "b1", "b2")}
    the_relay = relay.Relay(settings_for(dsn), dict(memories))
    assert the_relay.leadership.try_acquire()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    spent = {False: 0.0, True: 0.0}
    drained = {False: 0, True: 0}
    try:
        phase = 0
        while sum(drained.values()) < rows:
            on = phase % 2 == 1
            (watching.set if on else watching.clear)()
            for _ in range(PHASE_BATCHES):
                started = time.perf_counter()
                report = the_relay.drain_once()
                spent[on] += time.perf_counter() - started
                drained[on] += report.published
                for memory in memories.values():
                    memory.published.clear()
                if not report.selected:
                    raise SystemExit("bench: the table ran out of due rows")
            phase += 1
    finally:
        stop.set()
        watcher.join()
        the_relay.shutdown()
    return drained[False] / spent[False], drained[True] / spent[True]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", default=os.environ.get("BENCH_PG", "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--staged", type=int, default=1_000_000)
    parser.add_argument("--dead", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fetches", type=int, default=FETCHES, help="fetches of each page")
    parser.add_argument("--drained", type=int, default=DRAINED, help="due rows drained a round")
    parser.add_argument("--watch-every", type=float, default=WATCH_EVERY_S, help="seconds between fetches")
    parser.add_argument("--keep", action="store_true", help="keep the database (and reuse it next time)")
    args = parser.parse_args()
    name = (
        f"drain_bench_console_{args.staged}_{args.dead}"
        if args.keep
        else f"drain_bench_console_{os.getpid()}"
    )
    with psycopg.connect(f"{args.pg}/postgres", autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')
    dsn = f"{args.pg}/{name}"
    port = benchkit.free_port()
    log = Path(tempfile.gettempdir()) / f"{name}.log"
    console = None
    try:
        store.Store(settings_for(dsn)).migrate()
        started = time.perf_counter()
        if not exists:  # a kept database is reused as the last run left it (fewer due rows)
            populate(dsn, args.staged, args.dead)
        print(
            f"{args.staged:,} staged rows, {args.dead:,} dead letters ({time.perf_counter() - started:.0f} s)"
        )
        with open(log, "wb") as out:
            console = subprocess_console(dsn, port, out)
        base = f"http://127.0.0.1:{port}"
        benchkit.wait_for(lambda: port_open(port), 30, "the console to listen")
        print("pages:")
        met = time_pages(base, args.fetches, args.dead)
        print("plans:")
        print_plans(dsn)
        ratios = []
        for round_ in range(args.rounds):
            alone, watched = drain_rates(dsn, base, args.drained, args.watch_every)
            ratios.append(watched / alone)
            print(
                f"round {round_ + 1}: drain alone {alone:,.0f} jobs/s, watched {watched:,.0f} jobs/s, "
                f"ratio {ratios[-1]:.2f}"
            )
        print(
            f"pages under {TARGET_MS:.0f} ms: {'yes' if met else 'NO'}; drain rate watched / alone "
            f"(median of {args.rounds}): {statistics.median(ratios):.2f} (target >= {TARGET_RATIO})"
        )
    finally:
        if console is not None:
            console.terminate()
            console.wait(timeout=30)
        if not args.keep:
            with psycopg.connect(f"{args.pg}/postgres", autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def subprocess_console(dsn: str, port: int, out: Any) -> subprocess.Popen[bytes]:
    drain = str(Path(sys.executable).parent / "drain")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRAIN_", "PG"))}
    return subprocess.Popen(
        [drain, "console", "--dsn", dsn, "--port", str(port)], stdout=out, stderr=out, env=env
    )


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
