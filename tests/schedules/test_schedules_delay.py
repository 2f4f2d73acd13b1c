"""Delayed jobs (``delay`` / ``run_at``) reach RQ and RabbitMQ on time, by the database clock.

Jobs are staged with delays from 0.2 s to 3 s while the drain idles at the default
``poll_max_s`` (1 s). Each delivery is stamped with the database's ``clock_timestamp()`` at the
consumer (the RQ task, the pika callback) and compared with the row's ``run_at``: never before
it, and at most the README's bound after it (``poll_max_s`` plus a margin for the broker hop on
a busy machine). A scheduled tick's job also reaches RabbitMQ with its schedule and tick in the
message headers and the tick's job id as message_id.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import random
import statistics
import threading
import uuid
from typing import Any

import pika
import psycopg

import drain
from drain import config
from drain.relay import schedules
from drain.store import sql
from tests.support import processes, rabbit
from tests.support.rig import Rig
from tests.support.waiting import wait_until

POLL_MAX_S = config.POLL_MAX_S  # the default: what the README's bound is stated for
BOUND_S = POLL_MAX_S + 0.5  # poll_max_s, plus the broker and consumer hop on a busy machine
JOBS = 24
DELAYS_S = (0.2, 0.5, 0.8, 1.2, 2.0, 3.0)

EXPECTED = """
CREATE TABLE IF NOT EXISTS expected_run_at (
    job_id uuid PRIMARY KEY, run_at timestamptz NOT NULL, delay_s float8 NOT NULL
);
CREATE TABLE IF NOT EXISTS arrivals (job_id uuid NOT NULL, arrived_at timestamptz NOT NULL);
"""


def stage_delayed(dsn: str, queue: str, backend: str, job_name: str) -> None:
    """Stage JOBS jobs in small transactions at random moments; keep each row's run_at."""
    rng = random.Random(13)
    with psycopg.connect(dsn) as conn:
        conn.execute(EXPECTED)
        conn.commit()
        for start in range(0, JOBS, 3):
            delays = [DELAYS_S[n % len(DELAYS_S)] for n in range(start, start + 3)]
            jobs = [
                drain.Job(job_name, args=[n], queue=queue, backend=backend, delay=delay)
                for n, delay in zip(range(start, start + 3), delays, strict=True)
            ]
            ids = [str(job_id) for job_id in drain.stage_many(conn, jobs)]
            conn.execute(
                "INSERT INTO expected_run_at SELECT s.job_id, s.run_at, d.delay_s FROM staged_jobs s "
                "JOIN unnest(%s::uuid[], %s::float8[]) AS d(job_id, delay_s) USING (job_id)",
                (ids, delays),
            )
            conn.commit()
            threading.Event().wait(rng.uniform(0.05, 0.7))  # the drain idles and backs off meanwhile


@dataclasses.dataclass
class Figures:
    lateness_s: list[float]
    long_delay_lateness_s: list[float]

    def line(self, backend: str) -> str:
        return (
            f"{backend}: {len(self.lateness_s)} delayed jobs, lateness after run_at (database clock): "
            f"min {min(self.lateness_s) * 1000:.0f} ms, "
            f"median {statistics.median(self.lateness_s) * 1000:.0f} ms, "
            f"max {max(self.lateness_s) * 1000:.0f} ms; delay > poll_max_s: max "
            f"{max(self.long_delay_lateness_s) * 1000:.0f} ms"
        )


def lateness(dsn: str, arrivals: str) -> Figures:
    """Arrival minus run_at (database clock) of every delayed job; the first arrival of each."""
    with psycopg.connect(dsn) as conn:
        found = conn.execute(
            "SELECT extract(epoch FROM a.arrived_at - e.run_at)::float8, e.delay_s "
            f"FROM expected_run_at e JOIN (SELECT job_id, min(arrived_at) AS arrived_at FROM {arrivals} "
            "GROUP BY job_id) a USING (job_id)"
        ).fetchall()
    assert len(found) == JOBS, f"{len(found)} of {JOBS} delayed jobs arrived"
    return Figures([row[0] for row in found], [row[0] for row in found if row[1] > POLL_MAX_S])


def check(figures: Figures, backend: str) -> None:
    print(f"\n{figures.line(backend)}")
    assert min(figures.lateness_s) >= 0.0, "a delayed job arrived before its run_at"
    assert max(figures.lateness_s) <= BOUND_S, figures.line(backend)


def test_delayed_jobs_reach_rq_workers_on_time(rig: Rig) -> None:
    path = rig.tmp / "delay.toml"
    path.write_text(
        f"dsn = {json.dumps(rig.dsn)}\npoll_max_s = {POLL_MAX_S}\n"
        f'[backends.default]\ntype = "rq"\nurl = {json.dumps(rig.redis_url)}\n'
        f"allowed_jobs = {json.dumps(processes.ALLOWED_JOBS)}\n"
    )
    drain_ = processes.start_drain(path, rig.dsn, rig.tmp / "drain.log")
    with processes.running(drain_):
        wait_until("the drain to lead", lambda: processes.status(path, rig.dsn)["leader"], 30)
        stage_delayed(rig.dsn, rig.queue, "default", processes.ALLOWED_JOBS[0])
        wait_until(f"{JOBS} delayed jobs to run", lambda: delivered(rig.dsn) >= JOBS, 60)
    with psycopg.connect(rig.dsn, autocommit=True) as conn:
        conn.execute("CREATE VIEW rq_arrivals AS SELECT job_id, delivered_at AS arrived_at FROM deliveries")
    check(lateness(rig.dsn, "rq_arrivals"), "RQ")


def delivered(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(DISTINCT job_id) FROM deliveries").fetchone()
    return int(row[0]) if row else 0


class StampingConsumer(threading.Thread):
    """Consumes a queue; stamps each message with the database clock as it arrives."""

    def __init__(self, dsn: str, queue: str) -> None:
        super().__init__(name="stamping-consumer", daemon=True)
        self.dsn = dsn
        self.queue = queue
        self.stop = threading.Event()
        self.messages: list[tuple[Any, dict[str, Any]]] = []

    def run(self) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(rabbit.SHARED_URL))
        channel = connection.channel()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for method, properties, body in channel.consume(
                self.queue, auto_ack=True, inactivity_timeout=0.1
            ):
                if self.stop.is_set():
                    break
                if method is None:
                    continue
                conn.execute(
                    "INSERT INTO arrivals VALUES (%s, clock_timestamp())", (str(properties.message_id),)
                )
                self.messages.append((properties, json.loads(body)))
        connection.close()


def arrived(dsn: str) -> tuple[int, int]:
    """(delayed jobs arrived, other messages arrived: the ticks)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(DISTINCT e.job_id), count(*) FILTER (WHERE e.job_id IS NULL) "
            "FROM arrivals a LEFT JOIN expected_run_at e USING (job_id)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_delayed_jobs_and_a_tick_reach_rabbitmq_on_time(database: str) -> None:
    rabbit.need_rabbitmq()
    queue = rabbit.unique_name()
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(EXPECTED)
    tick = config.ScheduleSettings(
        name="every-second", cron="* * * * * *", job_name="app.tasks.tick", queue=queue, backend="events"
    )
    settings = rabbit.drain_settings(
        database, "events", {"url": rabbit.SHARED_URL}, poll_max_s=POLL_MAX_S, schedules=(tick,)
    )
    with rabbit.queues(rabbit.SHARED_URL, queue):
        consumer = StampingConsumer(database, queue)
        consumer.start()
        try:
            with rabbit.running_relay(settings):
                stage_delayed(database, queue, "events", "app.tasks.record")
                wait_until(
                    f"{JOBS} delayed jobs and two ticks",
                    lambda: (counts := arrived(database))[0] >= JOBS and counts[1] >= 2,
                    60,
                )
        finally:
            consumer.stop.set()
            consumer.join(30)
    check(lateness(database, "arrivals"), "RabbitMQ")
    scheduled = [(p, body) for p, body in consumer.messages if p.type == "app.tasks.tick"]
    assert scheduled, "no tick reached RabbitMQ"
    names = sql.Names("public", "staged_jobs")
    for properties, body in scheduled:
        headers = properties.headers
        assert headers["drain_schedule"] == "every-second"
        tick_at = datetime.datetime.fromisoformat(headers["drain_tick"])
        assert properties.message_id == str(schedules.tick_job_id(names, "every-second", tick_at))
        assert uuid.UUID(body["job_id"]) == uuid.UUID(properties.message_id)
