"""Keyed rows against unkeyed rows: the drain's rate when every row carries an ordering key (all
distinct, and 100 hot keys) against its rate over rows without one, in one run.

    .venv/bin/python bench/bench_ordering.py [--rows 50000] [--rounds 3] [--hot-keys 100]

Three staged-jobs tables in a database of its own (dropped afterwards): ``unkeyed`` (no row has
a key), ``distinct_keys`` (each row its own key) and ``hot_keys`` (the rows' keys taken in turn
from ``--hot-keys`` keys). Each round copies the same rows into the three tables, vacuums and analyzes
them, and drains them with ``drain_once`` (batch_size 500), batch by batch in alternation, through
the in-memory backend: no broker in the way, so the figure is the database side alone (the batch
query's probe of the key index per keyed row, the strictest case). A hot key's next row is due
only after the previous one was deleted, so a batch of the ``hot_keys`` table holds at most one row
per key: ``--hot-keys`` rows, not 500. Prints each round's rates and ratios, then the medians:
distinct keys / unkeyed (target >= 0.9) and hot keys / unkeyed (reported).
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
TABLES = ("unkeyed", "distinct_keys", "hot_keys")


def create_database(admin: str) -> str:
    name = f"drain_bench_ordering_{os.getpid()}"
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


def key_of(table: str, number: int, hot_keys: int) -> str | None:
    if table == "distinct_keys":
        return f"order-{number}"
    if table == "hot_keys":
        return f"hot-{number % hot_keys}"
    return None


def copy_rows(dsn: str, table: str, count: int, hot_keys: int) -> None:
    with psycopg.connect(dsn) as conn:
        with conn.cursor().copy(
            f"COPY {table} (job_name, job_args, job_id, ordering_key) FROM STDIN"  # bench-owned names
        ) as copy:
            for number in range(count):
                copy.write_row(
                    (
                        "app.tasks.send_email",
                        f'["user{number}@example.com"]',
                        uuid.uuid4(),
                        key_of(table, number, hot_keys),
                    )
                )
        conn.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {table}")


def drain_all(dsn: str, count: int) -> dict[str, float]:
    """Jobs per second of each table, drained batch by batch in alternation (unkeyed, distinct,
    hot, unkeyed, ...): a machine whose load changes during the run slows every side alike."""
    relays = {}
    memories = {}
    for table in TABLES:
        memories[table] = testing.MemoryAdapter("default")
        relays[table] = relay.Relay(settings_for(dsn, table), {"default": memories[table]})
        assert relays[table].leadership.try_acquire()
    spent = dict.fromkeys(TABLES, 0.0)
    published = dict.fromkeys(TABLES, 0)
    try:
        pending = set(relays)
        while pending:
            for table in TABLES:
                if table not in pending:
                    continue
                started = time.perf_counter()
                report = relays[table].drain_once()
                spent[table] += time.perf_counter() - started
                published[table] += report.published
                memories[table].published.clear()
                if not report.selected:
                    pending.discard(table)
    finally:
        for the_relay in relays.values():
            the_relay.shutdown()
    assert published == dict.fromkeys(TABLES, count), f"not every row was forwarded: {published}"
    return {table: count / seconds for table, seconds in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", default=os.environ.get("BENCH_PG", "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hot-keys", type=int, default=100)
    args = parser.parse_args()
    name = create_database(args.pg)
    dsn = f"{args.pg}/{name}"
    try:
        for table in TABLES:
            store.Store(settings_for(dsn, table)).migrate()
        distinct, hot = [], []
        for round_ in range(args.rounds):
            for table in TABLES:
                copy_rows(dsn, table, args.rows, args.hot_keys)
            rates = drain_all(dsn, args.rows)
            distinct.append(rates["distinct_keys"] / rates["unkeyed"])
            hot.append(rates["hot_keys"] / rates["unkeyed"])
            print(
                f"round {round_ + 1}: unkeyed {rates['unkeyed']:,.0f} jobs/s, distinct keys "
                f"{rates['distinct_keys']:,.0f} jobs/s (ratio {distinct[-1]:.2f}), {args.hot_keys} hot keys "
                f"{rates['hot_keys']:,.0f} jobs/s (ratio {hot[-1]:.2f})",
                flush=True,
            )
        print(
            f"distinct keys / unkeyed (median of {args.rounds} rounds): {statistics.median(distinct):.2f} "
            f"(target >= {TARGET_RATIO})"
        )
        print(
            f"{args.hot_keys} hot keys / unkeyed (median of {args.rounds} rounds): "
            f"{statistics.median(hot):.2f} (reported: a batch holds at most one row per key)"
        )
    finally:
        drop_database(args.pg, name)


if __name__ == "__main__":
    main()
