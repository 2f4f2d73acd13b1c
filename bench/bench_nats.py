"""NATS JetStream: the drain end to end against nats-py's own publishing with acks, measured in
the same run, and the duplicates a consumer sees after the drain is killed between publish and
delete.

sync   nats-py ``js.publish``: one message, its PubAck awaited, then the next.
async  nats-py ``js.publish_async``: up to 4,000 PubAcks outstanding (its default), then
       ``publish_async_completed``.
       Both: the drain's message (~300 B JSON body, ``Nats-Msg-Id`` and the drain's headers) to
       a subject of a file stream of the bench's own, no database.
alone  the drain's NATS adapter by itself: batches of --batch-size submitted, --pipeline-depth
       outstanding, no database (what the drain's own protocol costs, against nats-py's).
drain  Relay.drain_step() (the pipelined loop of `drain run`) from N staged rows until the table
       is empty and nothing is in flight; same stream, same messages.
cpu    the CPU a message costs the publishing process (nats-py's, the drain's) and the drain's
       Postgres session (read from /proc when Postgres runs on this machine): on a machine
       whose cores are all busy, the rates follow these.
kills  ``drain run`` killed (``os._exit``, like SIGKILL) at the failpoint between the PubAck and
       the DELETE, --kills times (5), then ``drain run --once``: the stream's copies of each job beyond
       the first (a consumer's duplicates).

Usage: python bench/bench_nats.py [--rows 100000] [--batch-size 500] [--pipeline-depth 4]
       [--kills 5] [--dsn postgresql://postgres@127.0.0.1:5432/postgres] [--nats nats://127.0.0.1:4222]

Creates a database and a stream with unique names and deletes both at the end.
Target: drain / the faster of sync and async >= 1.0; duplicates after the kills = 0.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import nats
import psycopg

import drain
from drain import backend, config
from drain.relay import loop as relay
from drain.store import session as store

try:
    from bench import benchkit
except ImportError:  # run as a file: this folder is on sys.path
    import benchkit  # type: ignore[no-redef]

ARGS = ["x" * 150]
QUEUE = "bench"
KILL_ROWS = 2_000


def message(subject: str) -> tuple[bytes, dict[str, str]]:
    """The body and headers the drain sends for one job (drain_adapters.nats.messages)."""
    job_id = str(uuid.uuid4())
    body = json.dumps(
        {
            "job_id": job_id,
            "job_name": "app.tasks.bench",
            "args": ARGS,
            "kwargs": {},
            "queue": subject,
            "created_at": "2024-01-01T00:00:00+00:00",
            "options": {},
        },
        separators=(",", ":"),
    ).encode()
    headers = {"Nats-Msg-Id": job_id, "Content-Type": "application/json", "Drain-Job-Name": "app.tasks.bench"}
    return body, headers


async def raw_publish(url: str, subject: str, count: int, *, outstanding: bool) -> tuple[float, float]:
    """Publish ``count`` messages with nats-py, awaiting each PubAck or many at once; (msg/s, this
    process's CPU microseconds a message)."""
    client = await nats.connect(url)
    try:
        js = client.jetstream(timeout=30)
        prepared = [message(subject) for _ in range(count)]
        started, cpu = time.perf_counter(), time.process_time()
        if outstanding:
            futures = [await js.publish_async(subject, body, headers=headers) for body, headers in prepared]
            await js.publish_async_completed()
            for future in futures:
                future.result()  # raises if JetStream refused one
        else:
            for body, headers in prepared:
                await js.publish(subject, body, headers=headers)
        return count / (time.perf_counter() - started), (time.process_time() - cpu) / count * 1e6
    finally:
        await client.close()


async def stream_call(url: str, action: str, name: str, subjects: list[str] | None = None) -> Any:
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        if action == "add":
            return await js.add_stream(name=name, subjects=subjects)
        if action == "purge":
            return await js.purge_stream(name)
        if action == "count":
            return (await js.stream_info(name)).state.messages
        if action == "ids":
            info = (await js.stream_info(name)).state
            ids: collections.Counter[str] = collections.Counter()
            for seq in range(info.first_seq, info.last_seq + 1):
                found = await js.get_msg(name, seq)
                ids[json.loads(found.data)["job_id"]] += 1
            return ids
        return await js.delete_stream(name)
    finally:
        await client.close()


def adapter_alone(url: str, stream: str, rows: int, batch_size: int, depth: int) -> float:
    """The drain's NATS adapter with no database: jobs per second."""
    from drain_adapters import nats as nats_backend

    from drain import models

    adapter = nats_backend.NatsAdapter.from_options("bench", section(url, stream), publish_timeout_s=30)
    created = datetime.datetime.now(datetime.UTC)
    batches = [
        [
            models.StagedJob(n, uuid.uuid4(), "app.tasks.bench", ARGS, {}, QUEUE, "bench", {}, created)
            for n in range(start, min(start + batch_size, rows))
        ]
        for start in range(0, rows, batch_size)
    ]
    adapter.open()
    try:
        started = time.perf_counter()
        tickets: list[Any] = []
        for batch in batches:
            tickets.append(adapter.submit(batch))
            if len(tickets) > depth:
                adapter.collect(tickets.pop(0))
        for ticket in tickets:
            adapter.collect(ticket)
        return rows / (time.perf_counter() - started)
    finally:
        adapter.close()


def stage(dsn: str, rows: int) -> set[str]:
    with psycopg.connect(dsn) as conn:
        ids = set()
        for start in range(0, rows, 5000):
            jobs = [
                drain.Job("app.tasks.bench", args=ARGS, queue=QUEUE, backend="bench")
                for _ in range(start, min(start + 5000, rows))
            ]
            ids.update(str(job_id) for job_id in drain.stage_many(conn, jobs))
        conn.commit()
        conn.autocommit = True
        conn.execute("VACUUM ANALYZE staged_jobs")
    return ids


def section(url: str, stream: str) -> dict[str, Any]:
    return {"url": url, "subject_prefix": stream, "queues": [QUEUE]}


def drain_end_to_end(
    dsn: str, url: str, stream: str, rows: int, batch_size: int, depth: int
) -> tuple[float, float, float | None]:
    """Stage ``rows`` jobs, then drain them with the Relay; return (jobs per second, this
    process's CPU microseconds a job, its Postgres session's when that server is on this
    machine, else None)."""
    stage(dsn, rows)
    settings = config.Settings(
        dsn=dsn,
        batch_size=batch_size,
        pipeline_depth=depth,
        publish_timeout_s=30,
        backends={"bench": config.BackendSettings("bench", "nats", 10, section(url, stream))},
    )
    the_relay = relay.Relay(settings, backend.build_adapters(settings.backends, settings.publish_timeout_s))
    try:
        assert the_relay.leadership.try_acquire()
        session = session_cpu_s(the_relay.leadership.pid)
        started, cpu = time.perf_counter(), time.process_time()
        forwarded = benchkit.drain_until_empty(the_relay)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        after = session_cpu_s(the_relay.leadership.pid)
    finally:
        the_relay.shutdown()
    if forwarded != rows:
        raise SystemExit(f"forwarded {forwarded} of {rows} rows")
    postgres = None if session is None or after is None else (after - session) / rows * 1e6
    return rows / elapsed, cpu / rows * 1e6, postgres


def session_cpu_s(pid: int | None) -> float | None:
    """The CPU seconds of a Postgres session's process, when it runs on this machine."""
    try:
        if pid is None or not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"postgres"):
            return None
        return benchkit.cpu_s(pid)
    except OSError:
        return None


def duplicates_after_kills(
    dsn: str, url: str, stream: str, batch_size: int, kills_wanted: int
) -> tuple[int, int, int]:
    """(duplicates in the stream, jobs missing from it, kills) after ``kills_wanted`` kills at
    after_publish."""
    committed = stage(dsn, KILL_ROWS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRAIN_", "PG"))}
    with tempfile.TemporaryDirectory() as tmp:
        backend_keys = {"type": "nats", **section(url, stream)}
        path = benchkit.write_config(Path(tmp) / "drain.toml", dsn, backend_keys, batch_size=batch_size)
        text = path.read_text().replace("[backends.default]", "[backends.bench]")
        path.write_text(text)
        kills = 0
        for _ in range(kills_wanted):
            done = subprocess.run(
                [benchkit.DRAIN, "run", "--config", str(path)],
                env={**env, "DRAIN_FAILPOINTS": "after_publish=exit@2"},
                capture_output=True,
                check=False,
            )
            kills += done.returncode == 137
        done = subprocess.run(
            [benchkit.DRAIN, "run", "--once", "--config", str(path)],
            env=env,
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"drain run --once failed: {done.stderr.decode()[-2000:]}")
    held: collections.Counter[str] = asyncio.run(stream_call(url, "ids", stream))
    duplicates = sum(count - 1 for count in held.values())
    return duplicates, len(committed - set(held)), kills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=config.DEFAULT_BATCH_SIZE)
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--pipeline-depth", type=int, default=config.PIPELINE_DEPTH)
    parser.add_argument("--kills", type=int, default=5, help="kills between publish and delete")
    args = parser.parse_args()

    suffix = uuid.uuid4().hex[:10]
    stream = f"DRAIN_BENCH_{suffix}"
    subject = f"{stream}.{QUEUE}"
    database = f"drain_bench_{suffix}"
    admin = psycopg.connect(args.dsn, autocommit=True)
    admin.execute(f'CREATE DATABASE "{database}"')
    bench_dsn = psycopg.conninfo.make_conninfo(args.dsn, dbname=database)
    asyncio.run(stream_call(args.nats, "add", stream, [f"{stream}.*"]))
    try:
        db = store.Store(config.Settings(dsn=bench_dsn))
        db.migrate()
        db.close()
        sync_rows = max(1_000, args.rows // 10)  # one ack at a time is slow; the rate is what counts
        one_at_a_time, _ = asyncio.run(raw_publish(args.nats, subject, sync_rows, outstanding=False))
        many, many_cpu = asyncio.run(raw_publish(args.nats, subject, args.rows, outstanding=True))
        asyncio.run(stream_call(args.nats, "purge", stream))
        alone = adapter_alone(args.nats, stream, args.rows, args.batch_size, args.pipeline_depth)
        asyncio.run(stream_call(args.nats, "purge", stream))
        end_to_end, drain_cpu, postgres_cpu = drain_end_to_end(
            bench_dsn, args.nats, stream, args.rows, args.batch_size, args.pipeline_depth
        )
        held = asyncio.run(stream_call(args.nats, "count", stream))
        asyncio.run(stream_call(args.nats, "purge", stream))
        duplicates, missing, kills = duplicates_after_kills(
            bench_dsn, args.nats, stream, args.batch_size, args.kills
        )
        best = max(one_at_a_time, many)
        print(f"nats-py js.publish, one ack at a time ({sync_rows:,} messages): {one_at_a_time:,.0f} msg/s")
        print(f"nats-py js.publish_async, many acks outstanding: {many:,.0f} msg/s")
        print(f"the drain's adapter alone, no database: {alone:,.0f} jobs/s ({alone / many:.2f} of async)")
        print(
            f"drain end to end (batch {args.batch_size}, pipeline depth {args.pipeline_depth}, "
            f"{args.rows:,} rows): {end_to_end:,.0f} jobs/s; the stream held {held:,}"
        )
        print(f"ratio: {end_to_end / best:.2f} (target >= 1.0, against the faster nats-py way)")
        session = "" if postgres_cpu is None else f", its Postgres session {postgres_cpu:.0f}"
        print(
            f"CPU a message (microseconds): nats-py publish_async {many_cpu:.0f}; "
            f"the drain {drain_cpu:.0f}{session}"
        )
        print(f"duplicates after {kills} kills between publish and delete: {duplicates} (missing {missing})")
        if kills != args.kills or missing:
            raise SystemExit(
                f"the kill run went wrong: {kills} kills of {args.kills}, {missing} jobs missing"
            )
    finally:
        asyncio.run(stream_call(args.nats, "delete", stream))
        admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        admin.close()


if __name__ == "__main__":
    sys.exit(main())
