"""Hostile rows never stop the RabbitMQ backend (issue 10): rows that AMQP, pika or RabbitMQ refuse,
written straight into ``staged_jobs`` at the head of the table as any app with INSERT could, with
good rows behind them. Each bad row is rejected before it is sent (RabbitMQ would otherwise close the
channel or the connection, failing every job in flight again and again), retried with backoff and
dead-lettered with its reason; every good row reaches a real consumer; the drain keeps running."""

from __future__ import annotations

import datetime
import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from drain_adapters import rabbitmq
from drain_adapters.rabbitmq import messages as rabbitmq_messages

import drain
from drain import models
from tests.support import configs, processes, rabbit
from tests.support.waiting import wait_until

BACKEND = "events"
MAX_ATTEMPTS = 3
GOOD_ROWS = 40
# A Postgres numeric (jsonb prints it in full) that json.loads would decode as a float: inf (the
# reader refuses it).
BEYOND_FLOAT = "1" + "0" * 400 + ".5"

# name -> (job_name, queue, args as JSON text, options, created_at or None, expected reason)
HOSTILE: dict[str, tuple[str, str | None, str, dict[str, Any], str | None, str]] = {
    "long job_name": ("j" * 300, None, "[]", {}, None, "job_name (the AMQP type) is 300 bytes"),
    "long queue": ("app.tasks.x", "q" * 300, "[]", {}, None, "queue (the routing key) is 300 bytes"),
    "huge header int": ("app.tasks.x", None, "[]", {"headers": {"n": 2**70}}, None, "outside signed 64 bits"),
    "long header key": (
        "app.tasks.x",
        None,
        "[]",
        {"headers": {"k" * 300: 1}},
        None,
        "a key in headers is 300",
    ),
    "priority 300": ("app.tasks.x", None, "[]", {"priority": 300}, None, "priority must be an integer 0-255"),
    "bad expiration": (
        "app.tasks.x",
        None,
        "[]",
        {"expiration": " 7"},
        None,
        "expiration must be milliseconds",
    ),
    "CC not an array": (
        "app.tasks.x",
        None,
        "[]",
        {"headers": {"CC": "q"}},
        None,
        "header CC must be an array",
    ),
    "header over a frame": (
        "app.tasks.x",
        None,
        "[]",
        {"headers": {"h": "x" * 140_000}},
        None,
        "more than one AMQP frame",
    ),
    "numeric beyond float": ("app.tasks.x", None, f"[{BEYOND_FLOAT}]", {}, None, "too large for a float"),
    "created before 1970": (
        "app.tasks.x",
        None,
        "[]",
        {},
        "1960-01-01T00:00:00Z",
        "created_at is before 1970",
    ),
}


@pytest.fixture(autouse=True)
def _need_broker() -> None:
    rabbit.need_rabbitmq()


def write_config(path: Path, dsn: str) -> Path:
    backends = {BACKEND: configs.rabbitmq(rabbit.SHARED_URL, max_attempts=MAX_ATTEMPTS, publish_timeout_s=5)}
    return configs.write_config(path, dsn, backends, batch_size=20, retry_base_s=0.1, retry_max_s=0.5)


def stage_hostile(conn: psycopg.Connection[Any], queue: str) -> dict[str, str]:
    """INSERT the hostile rows directly (as an app would, bypassing drain.stage); job_id -> case.
    The table's check goes first: it refuses a row created before 1970, which drain 0.1.0's
    schema took, and the drain still runs on that schema until `drain migrate`."""
    conn.execute("ALTER TABLE staged_jobs DROP CONSTRAINT drain_job_check")
    ids: dict[str, str] = {}
    for case, (job_name, row_queue, args, options, created_at, _reason) in HOSTILE.items():
        row = conn.execute(
            "INSERT INTO staged_jobs (job_name, job_args, queue, backend, options, created_at)"
            " VALUES (%s, %s::jsonb, %s, %s, %s::jsonb, coalesce(%s::timestamptz, now())) RETURNING job_id",
            (
                job_name,
                args.replace("1e400 + 0.5", "1" + "0" * 400 + ".5"),
                row_queue or queue,
                BACKEND,
                json.dumps(options),
                created_at,
            ),
        ).fetchone()
        assert row is not None
        ids[str(row[0])] = case
    return ids


def test_hostile_rows_are_dead_lettered_and_the_good_rows_behind_them_delivered(
    database: str, tmp_path: Path
) -> None:
    (queue,) = names = (rabbit.unique_name("hostile"),)
    with rabbit.queues(rabbit.SHARED_URL, *names), psycopg.connect(database) as conn:
        hostile = stage_hostile(conn, queue)
        good = {
            str(drain.stage(conn, "app.tasks.x", args=[n], queue=queue, backend=BACKEND))
            for n in range(GOOD_ROWS)
        }
        conn.commit()
        drain_process = processes.start_drain(
            write_config(tmp_path / "drain.toml", database), None, tmp_path / "drain.log"
        )
        with processes.running(drain_process), rabbit.Consumer(rabbit.SHARED_URL, names) as consumer:
            wait_until(
                "every good row at the consumer",
                lambda: set(consumer.received) >= good or consumer.error is not None,
                120,
            )
            wait_until("every hostile row dead-lettered", lambda: rabbit.staged_count(database) == 0, 120)
            assert drain_process.popen.poll() is None, drain_process.output()
        dead = {
            str(job_id): (attempts, error)
            for job_id, attempts, error in conn.execute(
                "SELECT job_id, attempts, error FROM staged_jobs_dead"
            )
        }
    assert consumer.error is None
    assert set(consumer.received) == good, "a hostile row was delivered, or a good one was not"
    assert consumer.mismatched == []
    assert set(dead) == set(hostile)
    for job_id, (attempts, error) in dead.items():
        case = hostile[job_id]
        assert attempts == MAX_ATTEMPTS, case
        assert HOSTILE[case][-1] in error, f"{case}: {error}"
    log = drain_process.output()
    assert "Traceback" not in log, log


def test_a_message_pika_refuses_in_basic_publish_is_its_rejection_and_tags_stay_in_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The net behind validation: ``basic_publish`` raising for one message (validation is
    bypassed here to reach it) rejects that message only. If the refused message took a delivery
    tag, the broker's acks would fall one short and the last job would never be confirmed."""
    real_build = rabbitmq_messages.build
    poisoned: set[uuid.UUID] = set()

    def build(job: models.StagedJob, **limits: Any) -> rabbitmq_messages.Message:
        message = real_build(job, **limits)
        if job.job_id in poisoned:
            message.properties.headers = {"n": 2**70}  # pika's encoder raises struct.error
        return message

    monkeypatch.setattr(rabbitmq_messages, "build", build)
    (queue,) = names = (rabbit.unique_name("net"),)
    now = datetime.datetime.now(datetime.UTC)

    def job(n: int, to: str = queue) -> models.StagedJob:
        return models.StagedJob(n, uuid.uuid4(), "app.x", [n], {}, to, BACKEND, {}, now)

    first = [job(1), job(2), job(3, rabbit.unique_name("nowhere")), job(4), job(5)]
    second = [job(6), job(7), job(8)]
    poisoned.update({first[1].job_id, first[3].job_id, second[0].job_id})
    adapter = rabbitmq.RabbitMQAdapter.from_options(BACKEND, {"url": rabbit.SHARED_URL}, publish_timeout_s=5)
    with rabbit.queues(rabbit.SHARED_URL, *names):
        try:
            adapter.open()
            results = {r.row_id: r for r in [*adapter.publish_batch(first), *adapter.publish_batch(second)]}
        finally:
            adapter.close()
        held = rabbit.take_all(rabbit.SHARED_URL, queue)
    outcome = {row_id: result.outcome for row_id, result in results.items()}
    assert outcome == {
        1: models.Outcome.PUBLISHED,
        2: models.Outcome.REJECTED,
        3: models.Outcome.RETRY,  # unroutable: its return matched to it, not to a neighbour
        4: models.Outcome.REJECTED,
        5: models.Outcome.PUBLISHED,
        6: models.Outcome.REJECTED,
        7: models.Outcome.PUBLISHED,
        8: models.Outcome.PUBLISHED,
    }
    assert "rabbitmq: error:" in (results[2].error or "")
    assert "NO_ROUTE" in (results[3].error or "")
    assert set(held) == {str(j.job_id) for j in (first[0], first[4], second[1], second[2])}
