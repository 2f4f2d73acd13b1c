"""The RabbitMQ backend when its broker dies or raises a memory alarm, on a private node.

One private ``rabbitmq-server`` serves the module (starting one costs seconds and RAM); each test
uses queues of its own on it. Lost = committed jobs that the broker does not hold afterwards:
confirmed messages in durable queues survive a SIGKILL of the broker.
"""

from __future__ import annotations

import datetime
import gc
import logging
import uuid
from collections.abc import Iterator

import pytest
from drain_adapters import rabbitmq

import drain
from drain import models
from tests.support import rabbit
from tests.support.waiting import wait_until

BACKEND = "rmq"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[rabbit.PrivateBroker]:
    with rabbit.private_broker(tmp_path_factory.mktemp("rabbit")) as node:
        yield node


def backend_up(the_relay: object) -> float | None:
    registry = the_relay.metrics.registry  # type: ignore[attr-defined]
    value: float | None = registry.get_sample_value("drain_backend_up", {"backend": BACKEND})
    return value


def test_broker_killed_mid_run_loses_nothing(broker: rabbit.PrivateBroker, database: str) -> None:
    names = tuple(rabbit.unique_name(f"kill{n}") for n in range(3))
    with rabbit.queues(broker.url, *names):
        committed = rabbit.stage_jobs(database, 20_000, names, BACKEND)
        options = {"url": broker.url, "connect_timeout_s": 2.0}
        settings = rabbit.drain_settings(database, BACKEND, options, publish_timeout_s=5.0)
        with rabbit.running_relay(settings) as the_relay:
            wait_until("forwarding to start", lambda: rabbit.staged_count(database) <= 17_000, 120)
            broker.kill()
            left_at_kill = rabbit.staged_count(database)
            wait_until("the drain to see the broker down", lambda: backend_up(the_relay) == 0, 60)
            broker.start()
            wait_until("the backlog to drain", lambda: rabbit.staged_count(database) == 0, 120)
            assert backend_up(the_relay) == 1
        held = set(rabbit.take_counts(broker.url, names))
    assert left_at_kill > 0, "the broker died after the run, not during it"
    lost = committed - held
    assert not lost, f"{len(lost)} committed jobs lost"


def test_memory_alarm_pauses_forwarding_and_resumes(
    broker: rabbit.PrivateBroker, database: str, caplog: pytest.LogCaptureFixture
) -> None:
    names = (rabbit.unique_name("alarm"),)
    caplog.set_level(logging.WARNING)
    with rabbit.queues(broker.url, *names):
        first = rabbit.stage_jobs(database, 1_000, names, BACKEND)
        settings = rabbit.drain_settings(database, BACKEND, {"url": broker.url}, publish_timeout_s=5.0)
        try:
            with rabbit.running_relay(settings) as the_relay:
                wait_until("the first jobs", lambda: rabbit.staged_count(database) == 0, 120)
                broker.set_memory_watermark(0)
                second = rabbit.stage_jobs(database, 2_000, names, BACKEND)
                wait_until("the drain to report the alarm", lambda: backend_up(the_relay) == 0, 60)
                assert rabbit.staged_count(database) > 0
                assert "blocks publishing" in caplog.text
                broker.set_memory_watermark(0.4)
                wait_until("forwarding to resume", lambda: rabbit.staged_count(database) == 0, 120)
                assert backend_up(the_relay) == 1
        finally:
            broker.set_memory_watermark(0.4)
        held = set(rabbit.take_counts(broker.url, names))
    lost = (first | second) - held
    assert not lost, f"{len(lost)} committed jobs lost"


def test_a_blocked_connection_is_dropped_not_left_open(broker: rabbit.PrivateBroker) -> None:
    """Under an alarm the broker stops reading, so a polite close would never be answered: the
    adapter shuts its socket down and pika closes it at once (not whenever the garbage collector
    happens to close a leaked socket)."""
    (queue,) = names = (rabbit.unique_name("blocked"),)
    now = datetime.datetime.now(datetime.UTC)
    jobs = [models.StagedJob(n, uuid.uuid4(), "app.x", [], {}, queue, BACKEND, {}, now) for n in range(3)]
    adapter = rabbitmq.RabbitMQAdapter.from_options(BACKEND, {"url": broker.url}, publish_timeout_s=3)
    with rabbit.queues(broker.url, *names):
        gc.disable()  # a leaked socket must not be closed behind the test's back
        try:
            others = rabbit.sockets_to(broker.port)  # the test's own (rabbit.queues)
            adapter.open()
            assert rabbit.sockets_to(broker.port) == others + 1
            broker.set_memory_watermark(0)
            with pytest.raises(drain.BackendUnavailable, match=r"blocks publishing|no confirm"):
                adapter.publish_batch(jobs)
            assert rabbit.sockets_to(broker.port) == others, "the blocked connection's socket is still open"
        finally:
            gc.enable()
            broker.set_memory_watermark(0.4)
            adapter.close()
