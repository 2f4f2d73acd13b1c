"""Rows that RabbitMQ would answer by closing the channel or the connection never reach Celery on
AMQP's channel (SPEC §7 "Every backend", G6): each is rejected before it is sent, with its reason,
and the good rows of the same batch are confirmed. Before, a header over ``frame_max`` (a long
``shadow``, a large ``headers`` option) made the broker close the connection and failed the whole
batch, again on every retry; a ``CC`` header that is no array of names or an ``expires`` that
makes the message TTL too large closed the channel and took every unconfirmed job with it."""

from __future__ import annotations

import datetime
import sys
import time
import uuid
from typing import Any

import amqp
import amqp.transport
import pika
import pytest
from drain_adapters import celery as celery_backend
from drain_adapters.amqp import link as amqp_link
from drain_adapters.celery import amqp_publisher as celery_amqp
from drain_adapters.celery import message as celery_message

import drain
from drain import models
from drain.backend import deadline as call_deadline
from tests.support import rabbit

GOOD = 3


@pytest.fixture(autouse=True)
def _need_broker() -> None:
    rabbit.need_rabbitmq()


def row(queue: str, **changes: Any) -> models.StagedJob:
    fields: dict[str, Any] = {
        "id": 1,
        "job_id": uuid.uuid4(),
        "job_name": "app.tasks.send",
        "args": [1],
        "kwargs": {},
        "queue": queue,
        "backend": "default",
        "options": {},
        "created_at": datetime.datetime.now(datetime.UTC),
        **changes,
    }
    return models.StagedJob(**fields)


def adapter(url: str = rabbit.SHARED_URL) -> celery_backend.CeleryAdapter:
    return celery_backend.CeleryAdapter.from_options(
        "hostile", {"broker_url": url, "allowed_jobs": ["app.**"]}, publish_timeout_s=5
    )


def publish_between_good_rows(
    url: str, queue: str, hostile: models.StagedJob
) -> tuple[models.PublishResult, list[models.PublishResult]]:
    """Publish good rows around ``hostile`` in one batch; its result and the good rows' results."""
    good = [row(queue, id=n + 2) for n in range(GOOD)]
    celery = adapter(url)
    celery.open()
    try:
        results = {r.row_id: r for r in celery.publish_batch([good[0], hostile, *good[1:]])}
    finally:
        celery.close()
    return results[hostile.id], [results[job.id] for job in good]


HOSTILE: dict[str, tuple[dict[str, Any], str]] = {
    "shadow over a frame": ({"options": {"shadow": "s" * 200_000}}, "more than one AMQP frame"),
    "headers over a frame": ({"options": {"headers": {"h": "x" * 200_000}}}, "more than one AMQP frame"),
    "CC not an array": ({"options": {"headers": {"CC": 5}}}, "header CC must be an array"),
    "CC to a reserved queue": ({"options": {"headers": {"BCC": ["amq.gen-x"]}}}, "reserved"),
    "a reserved queue": ({"queue": "amq.rabbitmq.reply-to"}, "reserved"),
    "an empty queue": ({"queue": ""}, "queue name is empty"),
    "job_name not Unicode": ({"job_name": "app.tasks.\udc80"}, "not valid Unicode"),
    "header not Unicode": ({"options": {"headers": {"h": ["\ud800"]}}}, "not valid Unicode"),
}


@pytest.mark.parametrize("changes", [case[0] for case in HOSTILE.values()], ids=list(HOSTILE))
def test_a_row_the_broker_would_close_on_is_rejected_alone(changes: dict[str, Any]) -> None:
    (queue,) = names = (rabbit.unique_name("celery-hostile"),)
    case = next(name for name, (value, _) in HOSTILE.items() if value is changes)
    changes = {"queue": queue, **changes}
    with rabbit.queues(rabbit.SHARED_URL, *names):
        hostile_row = row(**changes)
        hostile, good = publish_between_good_rows(rabbit.SHARED_URL, queue, hostile_row)
        held = rabbit.take_counts(rabbit.SHARED_URL, names, by="correlation_id")
    assert hostile.outcome is models.Outcome.REJECTED, (case, hostile)
    assert HOSTILE[case][1] in (hostile.error or ""), hostile.error
    assert [r.outcome for r in good] == [models.Outcome.PUBLISHED] * GOOD
    assert sum(held.values()) == GOOD and str(hostile_row.job_id) not in held


@pytest.mark.parametrize(
    "expires",
    [60 * 86_400, 10**9, "9998-12-31T00:00:00+00:00"],
    ids=["60 days", "31 years", "year 9998"],
)
def test_an_expiry_beyond_the_brokers_ttl_is_sent_with_the_header_and_no_ttl(expires: Any) -> None:
    """RabbitMQ takes a per-message TTL up to 2**32-1 ms in every version (3.10: ten years) and
    closes the channel beyond; ``expires`` in the header is what the worker enforces."""
    (queue,) = names = (rabbit.unique_name("celery-expires"),)
    with rabbit.queues(rabbit.SHARED_URL, *names):
        hostile_row = row(queue, options={"expires": expires})
        hostile, good = publish_between_good_rows(rabbit.SHARED_URL, queue, hostile_row)
        connection = pika.BlockingConnection(pika.URLParameters(rabbit.SHARED_URL))
        try:
            channel = connection.channel()
            seen = {}
            while (got := channel.basic_get(queue, auto_ack=True))[0] is not None:
                seen[got[1].correlation_id] = got[1]
        finally:
            connection.close()
    assert hostile.outcome is models.Outcome.PUBLISHED, hostile
    assert [r.outcome for r in good] == [models.Outcome.PUBLISHED] * GOOD
    properties = seen[str(hostile_row.job_id)]
    assert properties.expiration is None
    assert datetime.datetime.fromisoformat(properties.headers["expires"]) > datetime.datetime.now(
        datetime.UTC
    )


def test_a_channel_closed_over_one_message_blames_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """The net behind validation: a message the broker refuses all the same (validation is
    bypassed here: an ``expiration`` RabbitMQ 3.x refuses) closes the channel. py-amqp reads that
    close while writing a later message and raises it from that message's ``basic_publish``: it
    is the channel's failure, so every job of the batch not confirmed is retried, and none is
    rejected for a neighbour's fault. The next batch goes out on a new channel."""
    real_wire = celery_amqp.wire
    poisoned: set[uuid.UUID] = set()

    def wire(message: celery_message.CeleryMessage) -> celery_amqp.Wire:
        built, framed = real_wire(message)
        if message.job.job_id in poisoned:
            framed.properties["expiration"] = "1.5"  # RabbitMQ closes the channel: leftover_string
            framed.encoded_properties = amqp.Message._serialize_properties(framed)
        return built, framed

    monkeypatch.setattr(celery_amqp, "wire", wire)
    (queue,) = names = (rabbit.unique_name("celery-closed"),)
    first = [row(queue, id=n) for n in range(1, 301)]
    poisoned.add(first[1].job_id)
    second = [row(queue, id=n) for n in range(301, 304)]
    with rabbit.queues(rabbit.SHARED_URL, *names):
        celery = adapter()
        celery.open()
        try:
            results = celery.publish_batch(first)
            again = celery.publish_batch(second)
        finally:
            celery.close()
    outcomes = {r.row_id: r.outcome for r in results}
    assert len(outcomes) == len(first)
    assert models.Outcome.REJECTED not in outcomes.values(), [r for r in results if r.error][:3]
    assert outcomes[2] is models.Outcome.RETRY
    assert [r.outcome for r in again] == [models.Outcome.PUBLISHED] * len(second)


def test_a_batch_naming_more_new_queues_than_the_publish_timeout_can_declare_retries_the_rest() -> None:
    """Celery on AMQP declares each new queue (about 4-5 ms a queue on loopback) before publishing
    to it: 10,000 rows naming 10,000 queues held the batch's transaction a minute, past the
    session's fence (red team 25). Declaring stops at half the publish timeout; the jobs of the
    queues left are retried, uncounted, and go with a later batch."""
    names = [rabbit.unique_name("late-declare") for _ in range(150)]
    url = rabbit.SHARED_URL.replace("/%2F", "//")
    with rabbit.queues(rabbit.SHARED_URL, *names):
        adapter = celery_backend.CeleryAdapter.from_options(
            "late", {"broker_url": url, "allowed_jobs": ["app.**"]}, publish_timeout_s=0.2
        )
        adapter.open()
        try:
            waiting = [row(queue, id=n) for n, queue in enumerate(names)]
            first = adapter.publish_batch(waiting)
            rounds = 1
            late = {r.row_id for r in first if r.outcome is models.Outcome.RETRY}
            while late and rounds < 100:
                waiting = [job for job in waiting if job.id in late]
                answers = adapter.publish_batch(waiting)
                late = {r.row_id for r in answers if r.outcome is models.Outcome.RETRY}
                assert {r.outcome for r in answers} <= {models.Outcome.PUBLISHED, models.Outcome.RETRY}
                rounds += 1
        finally:
            adapter.close()
        held = rabbit.take_counts(rabbit.SHARED_URL, tuple(names), by="correlation_id")
    reasons = {r.error for r in first if r.outcome is models.Outcome.RETRY}
    assert reasons == {celery_amqp.LATE_DECLARATION}, "the first batch could not declare them all"
    assert not late
    assert sum(held.values()) == len(names) == len(held)


@pytest.mark.parametrize("failure", ["reset", "deadline"])
def test_a_batch_whose_write_fails_is_an_outage_and_the_next_goes_out(
    monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """A batch's frames are written together after they are all built. A write that fails (the
    connection reset) leaves no confirm to wait for: the backend is unavailable at once (the
    rows wait, no attempt counted), the connection is dropped (a frame may be half sent) and
    nothing names the password. A batch the call's deadline has passed before its frames are
    written is not written at all: its rows retry (no attempt counted) and the connection, with
    nothing half sent on it, stays. Either way the next batch goes out."""
    (queue,) = names = (rabbit.unique_name("celery-write"),)
    real_write = amqp.transport._AbstractTransport.write
    broken = [True]

    def write(self: Any, data: bytes) -> None:
        if broken[0] and len(data) > 1000:  # the batch, not the handshake or the probe
            broken[0] = False
            if failure == "reset":
                raise ConnectionResetError(104, "Connection reset by peer guest")
        real_write(self, data)

    monkeypatch.setattr(amqp.transport._AbstractTransport, "write", write)
    with rabbit.queues(rabbit.SHARED_URL, *names):
        celery = adapter()
        celery.open()
        try:
            if failure == "deadline":  # passed when the batch's frames are to be written
                real_bound = call_deadline.Deadline.bound

                def bound(self: call_deadline.Deadline, own_s: float | None) -> float | None:
                    return None if sys._getframe(1).f_code.co_name == "_flush" else real_bound(self, own_s)

                monkeypatch.setattr(call_deadline.Deadline, "bound", bound)
                unsent = celery.publish_batch([row(queue, id=n) for n in range(1, 21)])
                assert {r.outcome for r in unsent} == {models.Outcome.RETRY}
                assert {r.error for r in unsent} == {f"celery: {amqp_link.NOT_WRITTEN}"}
                assert broken == [True]  # nothing of it was written
                monkeypatch.undo()
                assert celery._amqp.link.connection_open  # type: ignore[union-attr]
            else:
                with pytest.raises(drain.BackendUnavailable) as caught:  # from submit: nothing to collect
                    celery.submit([row(queue, id=n) for n in range(1, 21)])
                assert "guest" not in str(caught.value)
                monkeypatch.undo()
                assert not celery._amqp.link.connection_open  # type: ignore[union-attr]
            again = celery.publish_batch([row(queue, id=n) for n in range(21, 41)])
        finally:
            celery.close()
        held = rabbit.take_counts(rabbit.SHARED_URL, names, by="correlation_id")
    assert [r.outcome for r in again] == [models.Outcome.PUBLISHED] * 20
    assert sum(held.values()) == 20


def test_a_write_cut_inside_a_chunk_counts_the_confirmed_messages_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch of 15 rows of 200 KB is written in three chunks of five whole messages; the third
    write is cut half way (a timeout: two whole messages and half a frame of the third on the
    wire). The connection is dropped, but the confirms already come are read first: the twelve
    rows written whole are PUBLISHED (each once in the queue), the other three RETRY, no outage;
    the next batch goes on a new connection."""
    (queue,) = names = (rabbit.unique_name("celery-cut"),)
    real_write = amqp.transport._AbstractTransport.write
    large = []

    def write(self: Any, data: bytes) -> None:
        if len(data) > 100_000:
            large.append(len(data))
            if len(large) == 3:
                real_write(self, data[: len(data) // 2])
                time.sleep(0.5)  # the broker confirms the first twelve meanwhile
                raise TimeoutError("timed out")
        real_write(self, data)

    monkeypatch.setattr(amqp.transport._AbstractTransport, "write", write)
    with rabbit.queues(rabbit.SHARED_URL, *names):
        celery = adapter()
        celery.open()
        try:
            batch = [row(queue, id=n, args=["x" * 200_000]) for n in range(1, 16)]
            results = celery.publish_batch(batch)
            assert not celery._amqp.link.connection_open  # type: ignore[union-attr]
            monkeypatch.undo()
            again = celery.publish_batch([row(queue, id=n) for n in range(16, 21)])
        finally:
            celery.close()
        held = rabbit.take_counts(rabbit.SHARED_URL, names, by="correlation_id")
    outcomes = {r.row_id: r.outcome for r in results}
    assert outcomes == {
        n: models.Outcome.PUBLISHED if n <= 12 else models.Outcome.RETRY for n in range(1, 16)
    }
    assert [r.outcome for r in again] == [models.Outcome.PUBLISHED] * 5
    by_id = {str(job.job_id): job.id for job in batch}
    assert sorted(by_id[job_id] for job_id in held if job_id in by_id) == list(range(1, 13))
    assert sum(held.values()) == 17
