"""Staging overhead: drain.stage() against a plain INSERT of the same row, and stage_many() of
10,000 jobs against COPY of the same rows, in one run.

    .venv/bin/python bench/bench_staging.py [--transactions 2000] [--many 10000] [--runs 3]

(a) One job per app transaction (BEGIN; the app's own INSERT; stage; COMMIT), N times, against
    the same transaction with a hand-written parameterised INSERT of the same row (arguments
    serialised with json.dumps, a uuid4 job id). Printed: the whole transaction's ratio and the
    staging call's own ratio (stage() / INSERT; target <= 1.2). The two loops alternate in blocks
    so that load on a shared machine hits both alike.
(b) stage_many() of --many jobs in one call and one transaction, against COPY of the same rows
    (the raw client limit); jobs/s for both and their ratio.

Each figure is the median of --runs runs. Needs PostgreSQL on 127.0.0.1:5432 (user postgres;
--pg or BENCH_PG); uses a database of its own and drops it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

import drain
from drain import config
from drain.store import session as store

JOB_NAME = "app.tasks.send_email"
TARGET_RATIO = 1.2
BLOCK = 100  # transactions per block; the two variants alternate block by block
RAW_INSERT = (
    "INSERT INTO staged_jobs (job_name, job_args, job_kwargs, queue, backend, job_id, options) "
    "VALUES (%s, %s::jsonb, %s::jsonb, %s, %s, %s, %s::jsonb)"
)


def args_for(number: int) -> list[object]:
    return [f"user{number}@example.com", number]


def one_per_transaction(dsn: str, count: int) -> tuple[float, float, float, float]:
    """Seconds for ``count`` transactions (whole transaction, staging call alone) per variant."""
    totals = {"stage": [0.0, 0.0], "insert": [0.0, 0.0]}

    def via_stage(conn: psycopg.Connection[Any], number: int) -> None:
        drain.stage(conn, JOB_NAME, args=args_for(number))

    def via_insert(conn: psycopg.Connection[Any], number: int) -> None:
        conn.execute(
            RAW_INSERT,
            (JOB_NAME, json.dumps(args_for(number)), "{}", "default", "default", uuid.uuid4(), "{}"),
        )

    variants: dict[str, Callable[[psycopg.Connection[Any], int], None]] = {
        "stage": via_stage,
        "insert": via_insert,
    }
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS users (id bigint GENERATED ALWAYS AS IDENTITY, email text)")
        conn.commit()
        for warm in variants.values():  # warm up: prepared statements, caches
            for number in range(50):
                warm(conn, number)
            conn.rollback()
        for start in range(0, count, BLOCK):
            for name, call in variants.items():
                for number in range(start, min(start + BLOCK, count)):
                    began = time.perf_counter()
                    conn.execute("INSERT INTO users (email) VALUES (%s)", (f"user{number}@example.com",))
                    before_call = time.perf_counter()
                    call(conn, number)
                    after_call = time.perf_counter()
                    conn.commit()
                    totals[name][0] += time.perf_counter() - began
                    totals[name][1] += after_call - before_call
    return totals["stage"][0], totals["stage"][1], totals["insert"][0], totals["insert"][1]


def many_in_one_call(dsn: str, count: int) -> tuple[float, float]:
    """Seconds for stage_many() of ``count`` jobs, and for COPY of the same rows."""
    jobs = [drain.Job(JOB_NAME, args=args_for(number)) for number in range(count)]
    with psycopg.connect(dsn) as conn:
        began = time.perf_counter()
        drain.stage_many(conn, jobs)
        conn.commit()
        staged = time.perf_counter() - began
        began = time.perf_counter()
        copy_in = "COPY staged_jobs (job_name, job_args, job_id) FROM STDIN"
        with conn.cursor() as cursor, cursor.copy(copy_in) as copy:
            for number in range(count):
                copy.write_row((JOB_NAME, json.dumps(args_for(number)), uuid.uuid4()))
        conn.commit()
        copied = time.perf_counter() - began
    return staged, copied


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", default=os.environ.get("BENCH_PG", "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--transactions", type=int, default=2000)
    parser.add_argument("--many", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    options = parser.parse_args()
    dbname = f"drain_bench_staging_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{options.pg}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{dbname}"')
    dsn = f"{options.pg}/{dbname}"
    try:
        db = store.Store(config.Settings(dsn=dsn))
        db.migrate()
        db.close()
        whole, call, many, copy = [], [], [], []
        for run in range(1, options.runs + 1):
            stage_txn, stage_call, insert_txn, insert_call = one_per_transaction(dsn, options.transactions)
            staged, copied = many_in_one_call(dsn, options.many)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("TRUNCATE staged_jobs, users")
            whole.append(stage_txn / insert_txn)
            call.append(stage_call / insert_call)
            many.append(options.many / staged)
            copy.append(options.many / copied)
            per = 1e6 / options.transactions
            print(
                f"run {run}: transaction stage/insert {whole[-1]:.3f} "
                f"({stage_txn * per:.0f} vs {insert_txn * per:.0f} us); call alone {call[-1]:.3f} "
                f"({stage_call * per:.0f} vs {insert_call * per:.0f} us); "
                f"stage_many {many[-1]:,.0f} jobs/s vs COPY {copy[-1]:,.0f} jobs/s"
            )
        print(
            f"median of {options.runs}: one job per app transaction: stage()/INSERT = "
            f"{statistics.median(whole):.3f} (whole transaction), {statistics.median(call):.3f} "
            f"(the call alone; target <= {TARGET_RATIO}); stage_many({options.many:,}) = "
            f"{statistics.median(many):,.0f} jobs/s, COPY = {statistics.median(copy):,.0f} jobs/s, "
            f"ratio {statistics.median(many) / statistics.median(copy):.2f}"
        )
    finally:
        with psycopg.connect(f"{options.pg}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
