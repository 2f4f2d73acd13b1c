"""A row whose queue name holds a carriage return or a line feed, on every AMQP backend.

RabbitMQ strips CR and LF from the names of the queues and exchanges it declares (so its CLI and
management UI can delete them) and answers declare-ok with the stripped name. No queue can have
such a name, so the row is at fault on its own: REJECTED, dead-lettered at ``max_attempts``, while
the rows of a normal queue of the same backend are delivered and the backend stays up.

Found by the generated-rows property test in CI. Before:

- Dramatiq's link waited for a declare-ok pika never matched (it came back under the stripped
  name), then called the whole backend unavailable, again at every retry;
- Celery declared the stripped queue, then waited on NO_ROUTE for ever ("declaring it again");
- the RabbitMQ backend published to the default exchange and retried on NO_ROUTE for ever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator

import psycopg
import pytest

import drain
from drain import config, relay
from tests.support import rabbit
from tests.support.waiting import wait_until

NAME = "amqp"
MAX_ATTEMPTS = 2
GOOD_ROWS = 30
DEADLINE_S = 60.0


def backend_options(kind: str) -> dict[str, object]:
    if kind == "celery":
        return {"broker_url": rabbit.SHARED_URL, "allowed_jobs": ["app.**"], "connect_timeout_s": 2.0}
    if kind == "dramatiq":
        return {"url": rabbit.SHARED_URL, "allowed_actors": ["app.tasks.record"], "connect_timeout_s": 2.0}
    return {"url": rabbit.SHARED_URL, "connect_timeout_s": 2.0}


@contextlib.contextmanager
def cleaned(queue: str) -> Iterator[None]:
    """Delete what any backend may have declared for ``queue`` (and, before the fix, for the name
    the broker made of the bad one): Dramatiq's .DQ/.XQ, Celery's exchange of the same name."""
    try:
        yield
    finally:
        names = (queue, f"{queue}.DQ", f"{queue}.XQ", f"{queue}x", f"{queue}x.DQ", f"{queue}x.XQ")
        with contextlib.suppress(Exception):
            rabbit.delete_queues(rabbit.SHARED_URL, *names)
        for exchange in (queue, f"{queue}x"):
            with contextlib.suppress(Exception):
                rabbit.delete_exchange(rabbit.SHARED_URL, exchange)


def job_ids(queue: str) -> set[str]:
    """The job ids ``queue`` holds (Celery's task id, Dramatiq's body ``message_id``), taken."""
    ids: set[str] = set()
    connection = rabbit.connect(rabbit.SHARED_URL)
    try:
        channel = connection.channel()
        while (got := channel.basic_get(queue, auto_ack=True))[0] is not None:
            _method, properties, body = got
            ids.add(str(properties.message_id or properties.correlation_id or json.loads(body)["message_id"]))
    finally:
        connection.close()
    return ids


def backend_up(the_relay: relay.Relay) -> float | None:
    value: float | None = the_relay.metrics.registry.get_sample_value("drain_backend_up", {"backend": NAME})
    return value


@pytest.mark.parametrize("line_break", ["\n", "\r"])
@pytest.mark.parametrize("kind", ["rabbitmq", "celery", "dramatiq"])
def test_a_queue_name_with_a_line_break_is_dead_lettered_and_its_backend_keeps_delivering(
    database: str, kind: str, line_break: str
) -> None:
    rabbit.need_rabbitmq()
    queue = rabbit.unique_name("linebreak").replace("-", "_")
    with cleaned(queue), rabbit.queues(rabbit.SHARED_URL, queue):
        with psycopg.connect(database) as conn:
            bad = drain.Job("app.tasks.record", queue=f"{queue}{line_break}x", backend=NAME)
            bad_id = str(drain.stage_many(conn, [bad])[0])
            conn.commit()
        good = rabbit.stage_jobs(database, GOOD_ROWS, (queue,), NAME)
        base = rabbit.drain_settings(database, NAME, {}, publish_timeout_s=5.0)
        backends = {NAME: config.BackendSettings(NAME, kind, MAX_ATTEMPTS, backend_options(kind))}
        seen_up: list[float | None] = []
        with rabbit.running_relay(dataclasses.replace(base, backends=backends)) as the_relay:

            def settled() -> bool:
                seen_up.append(backend_up(the_relay))
                return rabbit.staged_count(database) == 0

            wait_until("every row settled", settled, DEADLINE_S)
        held = job_ids(queue)
    with psycopg.connect(database) as conn:
        dead = conn.execute("SELECT job_id::text, attempts, error FROM staged_jobs_dead").fetchall()
    assert [(job_id, attempts) for job_id, attempts, _ in dead] == [(bad_id, MAX_ATTEMPTS)], dead
    assert "line break" in dead[0][2] or "no Dramatiq queue name" in dead[0][2], dead[0][2]
    assert good == set(held), f"{len(good - set(held))} of {GOOD_ROWS} good rows not delivered"
    assert 0 not in seen_up, "the backend went down over one row's queue"
