"""``python -m bench --quick`` still runs end to end and prints its table (no timed assertion).

The benchmarks are scripts nobody runs every day; this keeps them from rotting. The figures of a
quick run mean nothing and are not checked — only that every benchmark ran and reported a ratio.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import AMQP_URL, need_service
from tests.support import processes

EXPECTED_LINES = (
    "RQ: drain / enqueue_many",
    "RQ: +2 ms each way to Redis",
    "RQ: peak RSS over 2,000 rows (MB)",
    "RabbitMQ: drain / raw pika confirms",
    "RabbitMQ: backlog time, producers at 100/s / alone",
    "Celery on RabbitMQ: drain / send_task (confirms)",
    "Celery on Redis: drain / send_task",
    "Celery on RabbitMQ: drain -> Celery / drain -> RabbitMQ backend",
    "Dramatiq on RabbitMQ: drain / send() (confirms)",
    "Dramatiq on Redis: drain / send()",
    "NATS: drain / nats-py with acks (faster way)",
    "NATS: adapter alone / nats-py publish_async",
    "Due rows with 1M future rows / with none",
    "Keyed rows, distinct keys / unkeyed",
    "Keyed rows, 100 hot keys / unkeyed",
    "stage() / plain INSERT, the call alone",
    "Latency p50 (ms), RQ, 100 jobs/s",
    "Latency p99 (ms), RabbitMQ, 100 jobs/s",
    "Memory: peak RSS, rows of 1 KB to 50 MB (MB)",
    "Memory: peak RSS, non-ASCII rows, Celery on Redis (MB)",
    "Commit p50: staged_jobs INSERT, drain forwarding / plain",
    "Commit p99: drain_stage_v1(), drain forwarding / plain",
    "Commit p50: drain_stage_v1() / INSERT, no drain",
    "Drain CPU per job at 600/s / backlog, staged_jobs INSERT",
    "Drain CPU ms/1,000 jobs, backlog",
    "Drain CPU at 20 jobs/s (% of a core)",
    "Drain backend CPU ms/1,000 jobs, 600/s",
    "WAL bytes/job at 600/s, the app's transaction",
    "WAL bytes/job at 600/s, the drain",
    "Drain statements/batch, 600/s",
    "Flat out: staged_jobs INSERT, drain forwarding / plain (contention)",
    "Lanes, +5 ms: rate 4 drains / 1",
    "Lanes, +5 ms: CPU/job 4 drains / 1",
    "Lanes, no delay: rate 2 drains / 1",
    "Held snapshot: backlog median, held (rows)",
    "Held snapshot: drain CPU per job, held / none",
)


def test_python_m_bench_quick_prints_every_figure() -> None:
    need_service("Redis", "127.0.0.1", 6379)
    need_service("RabbitMQ", "127.0.0.1", int(AMQP_URL.rsplit(":", 1)[1].split("/")[0]))
    need_service("NATS", "127.0.0.1", 4222)
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick"],
        cwd=processes.ROOT,
        env=processes.environment("postgresql://unused"),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # the table is printed last; the benches' own lines before it may name a figure too
    table = done.stdout[done.stdout.rindex("\nfigure ") + 1 :]
    for name in EXPECTED_LINES:
        line = next((line for line in table.splitlines() if line.startswith(name)), None)
        assert line is not None, f"{name!r} missing from:\n{table}"
        median = line[len(name) :].split()[0]
        assert float(median) > 0, line
    assert "Traceback" not in done.stderr, done.stderr
