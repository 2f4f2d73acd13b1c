"""Future rows stay cheap: the drain's rate over due rows with 1,000,000 future-dated rows in the
table, against its rate with none, in one run.

    .venv/bin/python bench/bench_future_rows.py [--due 50000] [--future 1000000] [--rounds 3]

Two staged-jobs tables in a database of its own (dropped afterwards): ``plain`` holds only the
due rows, ``future`` the same due rows plus ``--future`` rows due tomorrow. Half of the due rows
are staged for now (run_at null), half were deferred and are due since a second ago (run_at in
the past), so both branches of the batch query are exercised. Each round copies the due rows
into both tables, vacuums and analyzes them, and drains both with ``drain_once`` (batch_size
500), batch by batch in alternation, through the in-memory backend: no broker in the way, so
the figure is the database side alone, the strictest case. Prints each round's rates and ratio,
and the median ratio (target >= 0.9).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import psycopg

from drain import config, testing
from drain.relay import loop as relay
from drain.store import session as store

TARGET_RATIO = 0.9
BATCH = 500


def create_database(admin: str) -> str:
    name = f"drain_bench_future_{os.getpid()}"
    with psycopg.connect(f"{admin}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return name


def drop_database(admin: str, name: str) -> None:
    with psycopg.connect(f"{admin}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def settings_for(dsn: str, table: str) -> config.Settings:
    return config.Settings(
        dsn=dsn,
        table=table,
        batch_size=BATCH,
        pipeline_depth=0,
        backends={"default": config.BackendSettings("default", "memory", 10, {})},
    )


def copy_due(dsn: str, table: str, count: int) -> None:
    with psycopg.connect(dsn) as conn:
        with conn.cursor().copy(
            f"COPY {table} (job_name, job_args, job_id, run_at) FROM STDIN"  # bench-owned names
        ) as copy:
            for number in range(count):
                run_at = None if number % 2 else "2000-01-01T00:00:00Z"
                copy.write_row(
                    ("app.tasks.send_email", f'["user{number}@example.com"]', uuid.uuid4(), run_at)
                )
        conn.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {table}")


def drain_both(dsn: str, count: int) -> dict[str, float]:
    """Jobs per second of each table, drained batch by batch in alternation (plain, future, plain,
    ...): a machine whose load changes during the run slows both sides alike."""
    relays = {}
    memories = {}
    for table in ("plain", "future"):
        memories[table] = testing.MemoryAdapter("default")
        relays[table] = relay.Relay(settings_for(dsn, table), {"default": memories[table]})
        assert relays[table].leadership.try_acquire()
    spent = {"plain": 0.0, "future": 0.0}
    try:
        pending = set(relays)
        while pending:
            for table in ("plain", "future"):
                if table not in pending:
                    continue
                started = time.perf_counter()
                selected = relays[table].drain_once().selected
                spent[table] += time.perf_counter() - started
                memories[table].published.clear()
                if not selected:
                    pending.discard(table)
    finally:
        for the_relay in relays.values():
            the_relay.shutdown()
    return {table: count / seconds for table, seconds in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", default=os.environ.get("BENCH_PG", "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--due", type=int, default=50_000)
    parser.add_argument("--future", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    name = create_database(args.pg)
    dsn = f"{args.pg}/{name}"
    try:
        for table in ("plain", "future"):
            store.Store(settings_for(dsn, table)).migrate()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO future (job_name, run_at) SELECT 'app.tasks.later', "
                "now() + interval '1 day' + g * interval '1 second' FROM generate_series(1, %s) AS g",
                (args.future,),
            )
            conn.execute("VACUUM ANALYZE future")
        rates: dict[str, list[float]] = {"plain": [], "future": []}
        ratios = []
        for round_ in range(args.rounds):
            for table in ("plain", "future"):
                copy_due(dsn, table, args.due)
            rates = drain_both(dsn, args.due)
            ratios.append(rates["future"] / rates["plain"])
            print(
                f"round {round_ + 1}: no future rows {rates['plain']:,.0f} jobs/s, "
                f"{args.future:,} future rows {rates['future']:,.0f} jobs/s, ratio {ratios[-1]:.2f}"
            )
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT count(*) FROM future").fetchone()
        assert row is not None and row[0] == args.future, "a future row was forwarded"
        print(
            f"ratio (median of {args.rounds} rounds): {statistics.median(ratios):.2f} "
            f"(target >= {TARGET_RATIO})"
        )
    finally:
        drop_database(args.pg, name)


if __name__ == "__main__":
    main()
