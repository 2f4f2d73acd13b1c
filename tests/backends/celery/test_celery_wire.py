"""The worker cannot tell the drain's message from ``send_task``'s: both are read back raw from
the broker and compared field by field (only what is fresh per send may differ: the delivery tag,
the reply-to id of the sending app, and the expiry date computed at send time)."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import json
import re
import struct
import uuid
from collections.abc import Iterator
from typing import Any

import amqp
import amqp.transport
import celery
import kombu.pools
import pika
import pytest
import redis
from drain_adapters import celery as celery_backend

import drain
from drain import models
from tests.support import celery_rig, faultload, rabbit

TASK = "tests.celery.compare"
OPTION_SETS = [
    {},
    {
        "priority": 5,
        "expires": 600,
        "time_limit": 30,
        "soft_time_limit": 20.5,
        "headers": {"tenant": "acme", "trace": [1, 2]},
        "retries": 2,
        "ignore_result": True,
        "shadow": "compare-shadow",
    },
]


def staged(queue: str, options: dict[str, Any]) -> models.StagedJob:
    return models.StagedJob(
        id=1,
        job_id=uuid.uuid4(),
        job_name=TASK,
        args=[1, "two", {"three": 3.5}, None, "é\u2028"],
        kwargs={"k": [True, False], "n": 12345678901234567890},
        queue=queue,
        backend="default",
        options=options,
        created_at=datetime.datetime.now(datetime.UTC),
    )


def send_task_like_an_app(broker_url: str, job: models.StagedJob, queue: str) -> None:
    app = celery.Celery("app", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = {"confirm_publish": True}
    options = dict(job.options)
    try:
        app.send_task(
            job.job_name, list(job.args), dict(job.kwargs), task_id=str(job.job_id), queue=queue, **options
        )
    finally:
        app.close()


def publish_through_the_drain(broker_url: str, job: models.StagedJob) -> None:
    adapter = celery_backend.CeleryAdapter.from_options(
        "wire", {"broker_url": broker_url, "allowed_jobs": ["tests.**"]}, publish_timeout_s=10
    )
    adapter.open()
    try:
        assert [r.outcome for r in adapter.publish_batch([job])] == [models.Outcome.PUBLISHED]
    finally:
        adapter.close()


def comparable_headers(headers: dict[str, Any]) -> dict[str, Any]:
    headers = dict(headers)
    if headers.get("expires"):
        sent = datetime.datetime.fromisoformat(headers["expires"])
        headers["expires"] = round(sent.timestamp() / 10)  # computed at send time: within seconds
    return headers


@pytest.fixture
def queues_on_redis(redis_db: str) -> Iterator[tuple[str, str, str]]:
    theirs, ours = rabbit.unique_name("sent"), rabbit.unique_name("drained")
    yield redis_db, theirs, ours
    for name in (theirs, ours):
        celery_rig.forget_queue(redis_db, name)


@pytest.mark.parametrize("options", OPTION_SETS, ids=["plain", "every-option"])
def test_redis_envelope_is_kombus(queues_on_redis: tuple[str, str, str], options: dict[str, Any]) -> None:
    url, theirs, ours = queues_on_redis
    job = staged(ours, options)
    send_task_like_an_app(url, job, theirs)
    publish_through_the_drain(url, job)
    client = redis.Redis.from_url(url)
    try:
        lists = {name: [k.decode() for k in client.keys(f"{name}*")] for name in (theirs, ours)}
        assert [key.replace(theirs, "Q") for key in lists[theirs]] == [
            key.replace(ours, "Q") for key in lists[ours]
        ], "same priority list"
        (sent_raw,) = client.lrange(lists[theirs][0], 0, -1)
        (drained_raw,) = client.lrange(lists[ours][0], 0, -1)
    finally:
        client.close()
    sent, drained = json.loads(sent_raw), json.loads(drained_raw)
    assert list(sent) == list(drained)
    assert base64.b64decode(sent["body"]) == base64.b64decode(drained["body"])
    assert comparable_headers(sent["headers"]) == comparable_headers(drained["headers"])
    assert list(sent["headers"]) == list(drained["headers"])
    sent_props, drained_props = sent["properties"], drained["properties"]
    assert list(sent_props) == list(drained_props)
    for fresh in ("delivery_tag", "reply_to"):
        assert uuid.UUID(sent_props.pop(fresh)) and uuid.UUID(drained_props.pop(fresh))
    assert sent_props.pop("delivery_info") == {"exchange": "", "routing_key": theirs}
    assert drained_props.pop("delivery_info") == {"exchange": "", "routing_key": ours}
    if "expiration" in sent_props:
        assert abs(int(sent_props.pop("expiration")) - int(drained_props.pop("expiration"))) < 5_000
    assert sent_props == drained_props
    assert {k: v for k, v in sent.items() if k not in ("body", "headers", "properties")} == {
        k: v for k, v in drained.items() if k not in ("body", "headers", "properties")
    }


@pytest.mark.parametrize("options", OPTION_SETS, ids=["plain", "every-option"])
def test_amqp_message_is_send_tasks(options: dict[str, Any]) -> None:
    rabbit.need_rabbitmq()
    theirs, ours = rabbit.unique_name("sent"), rabbit.unique_name("drained")
    with rabbit.queues(rabbit.SHARED_URL, ours):
        job = staged(ours, options)
        try:
            send_task_like_an_app(rabbit.SHARED_URL, job, theirs)  # send_task declares its queue
            publish_through_the_drain(rabbit.SHARED_URL, job)
            connection = pika.BlockingConnection(pika.URLParameters(rabbit.SHARED_URL))
            try:
                channel = connection.channel()
                _m1, sent, sent_body = channel.basic_get(theirs, auto_ack=True)
                _m2, drained, drained_body = channel.basic_get(ours, auto_ack=True)
            finally:
                connection.close()
        finally:
            celery_rig.forget_queue(rabbit.SHARED_URL, theirs)
    assert sent is not None and drained is not None
    assert sent_body == drained_body
    assert comparable_headers(sent.headers) == comparable_headers(drained.headers)
    for field in ("content_type", "content_encoding", "delivery_mode", "priority", "correlation_id"):
        assert getattr(sent, field) == getattr(drained, field), field
    assert drained.correlation_id == str(job.job_id)
    assert (sent.expiration is None) == (drained.expiration is None)
    if sent.expiration is not None:
        assert abs(int(sent.expiration) - int(drained.expiration)) < 5_000
    for absent in ("message_id", "type", "timestamp", "app_id", "user_id"):
        assert getattr(sent, absent) == getattr(drained, absent), absent
    assert uuid.UUID(sent.reply_to) and uuid.UUID(drained.reply_to)


def test_redis_a_queue_key_holding_no_list_rejects_that_row_alone(redis_db: str) -> None:
    client = redis.Redis.from_url(redis_db)
    taken, fine = rabbit.unique_name("string"), rabbit.unique_name("fine")
    client.set(taken, "not a list")
    adapter = celery_backend.CeleryAdapter.from_options(
        "wire", {"broker_url": redis_db, "allowed_jobs": ["tests.**"]}, publish_timeout_s=10
    )
    adapter.open()
    try:
        jobs = [
            dataclasses.replace(staged(fine, {}), id=1),
            dataclasses.replace(staged(taken, {}), id=2),
            dataclasses.replace(staged("unacked", {}), id=3),
            dataclasses.replace(staged("_kombu.binding.celery", {}), id=4),
            dataclasses.replace(staged(fine, {}), id=5),
        ]
        results = {r.row_id: r for r in adapter.publish_batch(jobs)}
    finally:
        adapter.close()
    outcomes = {row: result.outcome for row, result in results.items()}
    assert outcomes == {
        1: models.Outcome.PUBLISHED,
        2: models.Outcome.RETRY,  # its queue's list holds another type: the queue's fault
        3: models.Outcome.REJECTED,
        4: models.Outcome.REJECTED,
        5: models.Outcome.PUBLISHED,
    }
    assert "WRONGTYPE" in (results[2].error or "")
    assert client.llen(fine) == 2 and client.get(taken) == b"not a list"
    assert client.type("unacked") == b"none"
    client.close()


def test_amqp_a_dead_node_in_a_failover_broker_url_is_skipped() -> None:
    """``broker_url = "amqp://dead//;amqp://alive//"`` (kombu's spelling of a cluster): the first
    node refuses, the adapter publishes through the next within the same connect timeout."""
    rabbit.need_rabbitmq()
    port = faultload.free_port()
    dead = f"amqp://guest:s3cret@127.0.0.1:{port}//"
    alive = rabbit.SHARED_URL.replace("/%2F", "//")
    queue = rabbit.unique_name("failover")
    values = {"broker_url": f"{dead};{alive}", "allowed_jobs": ["tests.**"], "connect_timeout_s": 30}
    adapter = celery_backend.CeleryAdapter.from_options("default", values, publish_timeout_s=30)
    with rabbit.queues(rabbit.SHARED_URL, queue):
        job = staged(queue, {})
        try:
            adapter.open()
            assert [result.outcome for result in adapter.publish_batch([job])] == [models.Outcome.PUBLISHED]
        finally:
            adapter.close()
        connection = pika.BlockingConnection(pika.URLParameters(rabbit.SHARED_URL))
        try:
            _method, properties, _body = connection.channel().basic_get(queue, auto_ack=True)
        finally:
            connection.close()
        assert properties is not None and properties.correlation_id == str(job.job_id)
    values = {**values, "broker_url": f"{dead};{dead.replace('s3cret', 'other')}", "connect_timeout_s": 5}
    down = celery_backend.CeleryAdapter.from_options("default", values, publish_timeout_s=5)
    with pytest.raises(drain.BackendUnavailable) as caught:
        down.open()
    assert str(caught.value).count(f"127.0.0.1:{port}:") == 2
    assert "s3cret" not in str(caught.value) and "other" not in str(caught.value)


def published_frames(written: bytes) -> list[tuple[bytes, bytes, bytes]]:
    """Each ``basic.publish`` in the bytes a client wrote: (method payload, content header
    payload, body), the channel numbers left out (each client numbers its own)."""
    frames: list[tuple[int, bytes]] = []
    offset = 0
    while offset < len(written):
        kind, _channel, size = struct.unpack_from(">BHI", written, offset)
        frames.append((kind, written[offset + 7 : offset + 7 + size]))
        assert written[offset + 7 + size] == 0xCE
        offset += 8 + size
    published = []
    for index, (kind, payload) in enumerate(frames):
        if kind == 1 and payload[:4] == struct.pack(">HH", 60, 40):
            header = frames[index + 1][1]
            (size,) = struct.unpack_from(">Q", header, 4)
            body = b"".join(p for k, p in frames[index + 2 :] if k == 3)[:size]
            published.append((payload, header, body))
    return published


@pytest.mark.parametrize(
    "options", [OPTION_SETS[0], {k: v for k, v in OPTION_SETS[1].items() if k != "expires"}]
)
def test_amqp_frames_are_the_bytes_kombu_writes_for_send_task(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    """Byte for byte: the frames the drain builds for a batch (``amqp_frames``, with the headers
    table encoded by ``amqp_properties``) are those kombu has py-amqp write when ``send_task``
    sends the same task to the same queue, every byte but the sending app's reply-to id."""
    rabbit.need_rabbitmq()
    written: dict[str, list[bytes]] = {"send_task": [], "drain": []}
    sender = ["send_task"]
    real_write = amqp.transport._AbstractTransport.write

    def recording_write(self: Any, data: bytes) -> None:
        written[sender[0]].append(bytes(data))
        real_write(self, data)

    monkeypatch.setattr(amqp.transport._AbstractTransport, "write", recording_write)
    kombu.pools.reset()  # type: ignore[no-untyped-call]  # a connection of an earlier test's app, its writes not recorded
    queue = rabbit.unique_name("bytes")
    url = rabbit.SHARED_URL.replace("/%2F", "//")
    with rabbit.queues(rabbit.SHARED_URL, queue):
        job = staged(queue, options)
        send_task_like_an_app(url, job, queue)
        sender[0] = "drain"
        publish_through_the_drain(url, job)
    theirs = [p for p in published_frames(b"".join(written["send_task"])) if queue.encode() in p[0]]
    ours = [p for p in published_frames(b"".join(written["drain"])) if queue.encode() in p[0]]
    assert len(theirs) == len(ours) == 1
    (their_method, their_header, their_body), (method, header, body) = theirs[0], ours[0]
    # the same exchange ("") and routing key; the drain's is mandatory (its bits octet last)
    assert method == their_method[:-1] + b"\x01" and their_method[-1:] == b"\x00"
    assert body == their_body
    # reply_to, the last property present: each app's own id (a short string of 36 characters)
    reply_to = re.compile(rb"\x24[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
    assert reply_to.search(header) and reply_to.search(their_header)
    assert header[:-37] == their_header[:-37]
