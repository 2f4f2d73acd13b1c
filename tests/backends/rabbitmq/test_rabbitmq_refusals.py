"""Whose fault a RabbitMQ refusal is (issue 33): a permission is the backend's, no route the queue's.

A real ``drain run`` against the shared broker, counting committed vs delivered vs dead:

- the drain's user loses its write permission (``rabbitmqctl set_permissions`` on a vhost and a
  user of the test's own) while jobs keep coming: every publish closes the channel 403. The
  backend is unavailable: the rows stay untouched (no attempt, no error written), nothing is
  dead-lettered, and the log says so in a few lines, not the ~100 a second pika wrote before.
  Once the permission is back, every row is delivered within the backend's backoff;
- a queue deleted without ``declare = true``: its jobs come back NO_ROUTE. They wait
  uncounted (a line says the queue refuses them) while the other queues flow, and they are
  delivered once the queue exists again. Before, each was dead-lettered at max_attempts.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import drain
from tests.support import celery_rig, configs, faultload, ledger, processes, rabbit
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

JOB = celery_rig.ALLOWED_JOBS[0]
BACKENDS = ("rabbitmq", "celery")
OUTAGE_S = 4.0  # how long the permission stays revoked while jobs keep coming
MAX_OUTAGE_LINES = 12  # a line per cause per log_repeat_s, and the backoff's own
PROMPT_S = 20.0  # the longest the drain may take to deliver everything once the cause is gone


def stage(dsn: str, queues: tuple[str, ...], count: int, backend: str = "default") -> set[uuid.UUID]:
    jobs = [drain.Job(JOB, args=[n], queue=queues[n % len(queues)], backend=backend) for n in range(count)]
    with psycopg.connect(dsn) as conn, conn.cursor() as cursor:
        return set(drain.stage_many(cursor, jobs))


def rows(dsn: str) -> tuple[int, int, int]:
    """(staged rows, of them never attempted and without an error, dead-lettered rows)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE attempts = 0 AND last_error IS NULL),"
            " (SELECT count(*) FROM staged_jobs_dead) FROM staged_jobs"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def dead_ids(dsn: str) -> set[uuid.UUID]:
    with psycopg.connect(dsn) as conn:
        return {row[0] for row in conn.execute("SELECT job_id FROM staged_jobs_dead")}


@pytest.fixture
def vhost() -> Iterator[tuple[str, str, str]]:
    with rabbit.own_vhost() as made:
        yield made


def test_a_revoked_write_permission_is_an_outage_said_in_few_lines(
    database: str, tmp_path: Path, vhost: tuple[str, str, str]
) -> None:
    """Both AMQP backends at once, on one vhost: RabbitMQ (pika) and Celery (py-amqp)."""
    url, name, user = vhost
    queues = {backend: tuple(rabbit.unique_name(backend) for _ in range(3)) for backend in BACKENDS}
    celery = {"type": "celery", "broker_url": url, "allowed_jobs": [JOB]}
    sections = {"rabbitmq": configs.rabbitmq(url), "celery": celery}
    config = configs.write_config(
        tmp_path / "drain.toml", database, sections, max_attempts=2, log_repeat_s=10
    )
    committed: set[uuid.UUID] = set()

    def stage_each(count: int) -> None:
        for backend in BACKENDS:
            committed.update(stage(database, queues[backend], count, backend))

    with rabbit.queues(url, *queues["rabbitmq"], *queues["celery"]):
        the_drain = processes.start_drain(config, None, tmp_path / "drain.log")
        with processes.running(the_drain):
            stage_each(6)
            wait_until("the first jobs delivered", lambda: rows(database)[0] == 0, 60)
            rabbit.allow(name, user, write="^$")
            # An open channel may go on with its cached permission for a long while (measured: past
            # 90 s while the drain published every 0.1 s): the operator ends the vhost's
            # connections, as a revocation that must take effect does.
            rabbit.ctl("close_all_connections", "--vhost", name, "write permission revoked")
            stop = threading.Event()

            def keep_staging() -> None:  # about 60 jobs a second, as an app would
                while not stop.wait(0.1):
                    stage_each(3)

            def said(backend: str, lines: list[str]) -> bool:
                return any(f"backend {backend} unavailable" in line and "403" in line for line in lines)

            stager = threading.Thread(target=keep_staging, daemon=True)
            stager.start()
            try:  # from the first refusal on
                wait_until(
                    "both backends refused",
                    lambda: (
                        all(said(b, the_drain.output().splitlines()) for b in BACKENDS) or rows(database)[2]
                    ),
                    30,
                )
                before = len(the_drain.output().splitlines())
                time.sleep(OUTAGE_S)  # the outage lasts this long: what the log says meanwhile
            finally:
                stop.set()
                stager.join(10)
            log = the_drain.output().splitlines()
            staged, clean, dead = rows(database)
            assert dead == 0 and clean == staged > 0, (
                f"rows must wait untouched (staged, untouched, dead = {staged}, {clean}, {dead})\n"
                + "\n".join(log[-20:])
            )
            window = log[before:]
            assert len(window) <= MAX_OUTAGE_LINES, f"{len(window)} lines in {OUTAGE_S}s:\n" + "\n".join(
                window[:40]
            )
            rabbit.allow(name, user, write=".*")
            fixed = time.monotonic()
            wait_until("every row delivered after the fix", lambda: rows(database)[0] == 0, 60)
            took_s = time.monotonic() - fixed
            assert the_drain.alive(), the_drain.output()[-3000:]
        held = rabbit.take_counts(url, queues["rabbitmq"])
        held += rabbit.take_counts(url, queues["celery"], by="correlation_id")
    tally = ledger.Tally(
        committed, collections.Counter({uuid.UUID(i): n for i, n in held.items()}), dead_ids(database)
    )
    faultload.report(
        f"AMQP: write permission revoked, {len(window)} log lines in {OUTAGE_S:.0f}s,"
        f" {staged} rows untouched, delivered {took_s:.1f}s after the fix",
        tally,
    )
    assert not tally.dead
    tally.check()
    assert took_s <= PROMPT_S, f"delivered {took_s:.1f}s after the fix"


def test_a_deleted_queue_waits_uncounted_while_the_others_flow(database: str, tmp_path: Path) -> None:
    queues = tuple(rabbit.unique_name("gone") for _ in range(3))
    gone = queues[0]
    backends = {"default": configs.rabbitmq(rabbit.SHARED_URL)}
    config = configs.write_config(tmp_path / "drain.toml", database, backends, max_attempts=2)
    with rabbit.queues(rabbit.SHARED_URL, *queues):
        rabbit.delete_queues(rabbit.SHARED_URL, gone)
        committed = stage(database, queues, 21)
        the_drain = processes.start_drain(config, None, tmp_path / "drain.log")
        with processes.running(the_drain):
            refusing = f"queue {gone} refuses its jobs"
            wait_until(
                "the other queues delivered and the deleted one reported twice",
                lambda: (
                    (rows(database)[0] == 7 and the_drain.output().count(refusing) >= 2)
                    or rows(database)[2] > 0
                ),
                60,
            )
            with psycopg.connect(database) as conn:
                waiting = conn.execute("SELECT queue, attempts FROM staged_jobs").fetchall()
            assert waiting == [(gone, 0)] * 7, waiting
            with rabbit.queues(rabbit.SHARED_URL, gone):  # the operator declares it again
                fixed = time.monotonic()
                wait_until("the deleted queue's rows delivered", lambda: rows(database)[0] == 0, 60)
                took_s = time.monotonic() - fixed
                held = rabbit.take_counts(rabbit.SHARED_URL, queues)
            assert the_drain.alive(), the_drain.output()[-3000:]
    tally = ledger.Tally(
        committed, collections.Counter({uuid.UUID(i): n for i, n in held.items()}), dead_ids(database)
    )
    faultload.report(f"rabbitmq: a deleted queue, delivered {took_s:.1f}s after it was back", tally)
    assert not tally.dead
    tally.check()
    assert took_s <= PROMPT_S, f"delivered {took_s:.1f}s after the fix"
