"""A RabbitMQ batch leaves in a few large socket sends, not three per message, and arrives intact."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from drain_adapters import rabbitmq
from pika.adapters.utils import io_services_utils

import drain
from drain.relay import loop as relay
from tests.support import rabbit

BACKEND = "events"
JOBS = 300


@pytest.fixture(autouse=True)
def _need_broker() -> None:
    rabbit.need_rabbitmq()


def test_a_batch_is_sent_in_a_few_sends_and_every_message_arrives_whole(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sends: list[int] = []
    send = io_services_utils._AsyncTransportBase._sigint_safe_send

    def counting_send(sock: Any, data: bytes) -> int:
        sent: int = send(sock, data)
        sends.append(sent)
        return sent

    monkeypatch.setattr(
        io_services_utils._AsyncTransportBase, "_sigint_safe_send", staticmethod(counting_send)
    )
    (queue,) = names = (rabbit.unique_name("sends"),)
    with rabbit.queues(rabbit.SHARED_URL, *names):
        with psycopg.connect(database) as conn:
            staged = {
                str(drain.stage(conn, "app.tasks.a", args=[n, "x" * n], queue=queue, backend=BACKEND))
                for n in range(JOBS)
            }
        settings = rabbit.drain_settings(database, BACKEND, {"url": rabbit.SHARED_URL}, batch_size=JOBS)
        adapter = rabbitmq.RabbitMQAdapter.from_options(
            BACKEND, {"url": rabbit.SHARED_URL}, publish_timeout_s=30
        )
        the_relay = relay.Relay(settings, {BACKEND: adapter})
        try:
            assert the_relay.leadership.try_acquire()
            adapter.open()
            before = len(sends)
            report = the_relay.drain_once()
            batch_sends = len(sends) - before
        finally:
            the_relay.shutdown()
        assert report.published == JOBS
        held = rabbit.take_all(rabbit.SHARED_URL, queue)
    assert set(held) == staged
    assert all(body["args"][1] == "x" * body["args"][0] for _, body in held.values())
    # 3 frames a message: 900 sends uncoalesced; a few (partial sends of a large chunk) when joined,
    # and those of the connection the relay opens (handshake, channel, confirm mode, probe).
    assert batch_sends <= 12, batch_sends
