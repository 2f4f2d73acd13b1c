"""The adapter contract (drain.backend.Adapter), one suite run against every backend.

Each backend gives a harness: build an adapter, read back what the broker holds by job id, make a
job its backend refuses for its own data (and, for AMQP, one with no route), and build an
adapter whose broker is unreachable (a closed loopback port).
Real brokers are the machine's shared ones, used through a Redis db index or queues of the test's
own.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from drain import errors, models, testing
from drain.backend import Adapter, PipelinedAdapter
from tests.support import faultload, jetstream, proxy, rabbit
from tests.support.waiting import wait_until

NAME = "contract"


class Harness(Protocol):
    queue: str

    def build(self) -> Adapter: ...

    def held(self, job_ids: list[uuid.UUID]) -> dict[str, Any]:
        """The job ids (as strings) the broker holds, among ``job_ids``, with what it holds."""
        ...

    def refused(self, job: models.StagedJob) -> models.StagedJob:
        """``job`` changed so that its backend refuses it for its own data."""
        ...

    def unrouted(self, job: models.StagedJob) -> models.StagedJob | None:
        """``job`` sent to a queue with no route, or None where a queue needs no route."""
        ...

    def build_down(self) -> Adapter: ...

    def broker(self) -> tuple[str, int] | None:
        """Where the real broker listens (None for the in-memory backend)."""
        ...

    def build_at(self, port: int) -> Adapter:
        """An adapter whose broker is reached at 127.0.0.1:``port`` (a proxy in front of it)."""
        ...


def make_job(row_id: int, queue: str, **changes: Any) -> models.StagedJob:
    job = models.StagedJob(
        id=row_id,
        job_id=uuid.uuid4(),
        job_name="tests.contract.job",
        args=[row_id, "x" * 200],
        kwargs={"n": row_id},
        queue=queue,
        backend=NAME,
        options={},
        created_at=datetime.datetime.now(datetime.UTC),
    )
    return dataclasses.replace(job, **changes)


class MemoryHarness:
    queue = "default"

    def __init__(self) -> None:
        self.last: testing.MemoryAdapter | None = None

    def build(self) -> Adapter:
        adapter = testing.PipelinedMemoryAdapter(NAME)
        adapter.behaviour = lambda job: "reject" if job.job_name == "unroutable" else "ack"
        self.last = adapter
        return adapter

    def held(self, job_ids: list[uuid.UUID]) -> dict[str, Any]:
        assert self.last is not None
        wanted = {str(job_id) for job_id in job_ids}
        return {str(job.job_id): job for job in self.last.published if str(job.job_id) in wanted}

    def refused(self, job: models.StagedJob) -> models.StagedJob:
        return dataclasses.replace(job, job_name="unroutable")

    def unrouted(self, job: models.StagedJob) -> models.StagedJob | None:
        return None

    def build_down(self) -> Adapter:
        adapter = testing.MemoryAdapter(NAME)
        adapter.down = True
        self.last = adapter
        return adapter

    def broker(self) -> tuple[str, int] | None:
        return None

    def build_at(self, port: int) -> Adapter:
        raise NotImplementedError


class RQHarness:
    def __init__(self, url: str) -> None:
        self.url = url
        self.queue = rabbit.unique_name("contract")

    def build(self) -> Adapter:
        from drain_adapters import rq

        return rq.RQAdapter.from_options(
            NAME, {"url": self.url, "allowed_jobs": ["tests.contract.job"]}, publish_timeout_s=5
        )

    def held(self, job_ids: list[uuid.UUID]) -> dict[str, Any]:
        import redis
        from rq import job as rq_job
        from rq import queue as rq_queue

        client = redis.Redis.from_url(self.url)
        try:
            queued = set(rq_queue.Queue(self.queue, connection=client).get_job_ids())
            found = {}
            for job_id in job_ids:
                key = str(job_id)
                if key in queued:
                    found[key] = rq_job.Job.fetch(key, connection=client)
            return found
        finally:
            client.close()

    def refused(self, job: models.StagedJob) -> models.StagedJob:
        return dataclasses.replace(job, job_name="os.system")

    def unrouted(self, job: models.StagedJob) -> models.StagedJob | None:
        return None

    def build_down(self) -> Adapter:
        from drain_adapters import rq

        url = f"redis://127.0.0.1:{faultload.free_port()}/0"
        return rq.RQAdapter.from_options(
            NAME, {"url": url, "allowed_jobs": ["tests.contract.job"]}, publish_timeout_s=2
        )

    def broker(self) -> tuple[str, int] | None:
        parts = urllib.parse.urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 6379

    def build_at(self, port: int) -> Adapter:
        from drain_adapters import rq

        url = urllib.parse.urlsplit(self.url)._replace(netloc=f"127.0.0.1:{port}").geturl()
        return rq.RQAdapter.from_options(
            NAME, {"url": url, "allowed_jobs": ["tests.contract.job"]}, publish_timeout_s=2
        )


class RabbitMQHarness:
    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.taken: dict[str, Any] = {}

    def build(self) -> Adapter:
        from drain_adapters import rabbitmq

        return rabbitmq.RabbitMQAdapter.from_options(NAME, {"url": rabbit.SHARED_URL}, publish_timeout_s=30)

    def held(self, job_ids: list[uuid.UUID]) -> dict[str, Any]:
        self.taken.update(rabbit.take_all(rabbit.SHARED_URL, self.queue))
        wanted = {str(job_id) for job_id in job_ids}
        return {key: value for key, value in self.taken.items() if key in wanted}

    def refused(self, job: models.StagedJob) -> models.StagedJob:
        return dataclasses.replace(job, options={"priority": 999})

    def unrouted(self, job: models.StagedJob) -> models.StagedJob | None:
        return dataclasses.replace(job, queue=rabbit.unique_name("nowhere"))

    def build_down(self) -> Adapter:
        from drain_adapters import rabbitmq

        url = f"amqp://guest:guest@127.0.0.1:{faultload.free_port()}/%2F"
        return rabbitmq.RabbitMQAdapter.from_options(NAME, {"url": url}, publish_timeout_s=2)

    def broker(self) -> tuple[str, int] | None:
        parts = urllib.parse.urlsplit(rabbit.SHARED_URL)
        return parts.hostname or "127.0.0.1", parts.port or 5672

    def build_at(self, port: int) -> Adapter:
        from drain_adapters import rabbitmq

        url = f"amqp://guest:guest@127.0.0.1:{port}/%2F"
        return rabbitmq.RabbitMQAdapter.from_options(NAME, {"url": url}, publish_timeout_s=2)


class CeleryHarness:
    """Celery on RabbitMQ: a job's task id (the ``id`` header) is its job id; with
    ``task_create_missing_queues = false`` (the drain declares no queue, as Celery then would not),
    a missing queue is unroutable."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.taken: dict[str, Any] = {}

    def build(self) -> Adapter:
        from drain_adapters import celery

        options = {
            "broker_url": rabbit.SHARED_URL,
            "allowed_jobs": ["tests.contract.*"],
            "task_create_missing_queues": False,
        }
        return celery.CeleryAdapter.from_options(NAME, options, publish_timeout_s=30)

    def held(self, job_ids: list[uuid.UUID]) -> dict[str, Any]:
        connection = rabbit.connect(rabbit.SHARED_URL)
        try:
            channel = connection.channel()
            while True:
                method, properties, body = channel.basic_get(self.queue, auto_ack=True)
                if method is None:
                    break
                self.taken[str(properties.headers["id"])] = (properties, body)
        finally:
            connection.close()
        wanted = {str(job_id) for job_id in job_ids}
        return {key: value for key, value in self.taken.items() if key in wanted}

    def refused(self, job: models.StagedJob) -> models.StagedJob:
        return dataclasses.replace(job, job_name="os.system")

    def unrouted(self, job: models.StagedJob) -> models.StagedJob | None:
        return dataclasses.replace(job, queue=rabbit.unique_name("nowhere"))

    def build_down(self) -> Adapter:
        from drain_adapters import celery

        url = f"amqp://guest:guest@127.0.0.1:{faultload.free_port()}//"
        return celery.CeleryAdapter.from_options(
            NAME, {"broker_url": url, "allowed_jobs": ["**"]}, publish_timeout_s=2
        )

    def broker(self) -> tuple[str, int] | None:
        parts = urllib.parse.urlsplit(rabbit.SHARED_URL)
        return parts.hostname or "127.0.0.1", parts.port or 5672

    def build_at(self, port: int) -> Adapter:
        from drain_adapters import celery

        url = f"amqp://guest:guest@127.0.0.1:{port}//"
        options = {"broker_url": url, "allowed_jobs": ["tests.contract.*"]}
        return celery.CeleryAdapter.from_options(NAME, options, publish_timeout_s=2)


class DramatiqRedisHarness:
    """Dramatiq on Redis: a job's message sits in its queue's hash under its job id, and the id
    in its queue's list; an actor outside ``allowed_actors`` is this backend's refused job."""

    keeps_in_flight = False  # submit runs the batch's one script call: nothing waits for a reply

    def __init__(self, url: str) -> None:
        self.url = url
        self.queue = rabbit.unique_name("contract")

    def _options(self, url: str) -> dict[str, Any]:
        return {"url": url, "allowed_actors": ["tests.contract.job"]}

    def build(self) -> Adapter:
        from drain_adapters import dramatiq

        return dramatiq.DramatiqAdapter.from_options(NAME, self._options(self.url), publish_timeout_s=5)

    def held(self, job_ids: list[uuid.UUID]) -> dict[str, Any]:
        import redis

        client = redis.Redis.from_url(self.url)
        try:
            queued = {item.decode() for item in client.lrange(f"dramatiq:{self.queue}", 0, -1)}
            wanted = {str(job_id) for job_id in job_ids}
            found = {}
            for key, body in client.hgetall(f"dramatiq:{self.queue}.msgs").items():
                message = json.loads(body)  # keyed by <job id>:<row id>; the body names the job
                if key.decode() in queued and message["message_id"] in wanted:
                    found[message["message_id"]] = message
            return found
        finally:
            client.close()

    def refused(self, job: models.StagedJob) -> models.StagedJob:
        return dataclasses.replace(job, job_name="os.system")

    def unrouted(self, job: models.StagedJob) -> models.StagedJob | None:
        return None  # the adapter declares each queue before its first publish

    def build_down(self) -> Adapter:
        from drain_adapters import dramatiq

        url = f"redis://127.0.0.1:{faultload.free_port()}/0"
        return dramatiq.DramatiqAdapter.from_options(NAME, self._options(url), publish_timeout_s=2)

    def broker(self) -> tuple[str, int] | None:
        parts = urllib.parse.urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 6379

    def build_at(self, port: int) -> Adapter:
        from drain_adapters import dramatiq

        url = urllib.parse.urlsplit(self.url)._replace(netloc=f"127.0.0.1:{port}").geturl()
        return dramatiq.DramatiqAdapter.from_options(NAME, self._options(url), publish_timeout_s=2)


class DramatiqAmqpHarness:
    """Dramatiq on RabbitMQ: the message id is in the body (Dramatiq sets no AMQP message_id)."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.taken: dict[str, Any] = {}

    def _build(self, url: str, timeout_s: float) -> Adapter:
        from drain_adapters import dramatiq

        options = {"url": url, "allowed_actors": ["tests.contract.job"]}
        return dramatiq.DramatiqAdapter.from_options(NAME, options, publish_timeout_s=timeout_s)

    def build(self) -> Adapter:
        return self._build(rabbit.SHARED_URL, 30)

    def held(self, job_ids: list[uuid.UUID]) -> dict[str, Any]:
        connection = rabbit.connect(rabbit.SHARED_URL)
        try:
            channel = connection.channel()
            while True:
                method, _properties, body = channel.basic_get(self.queue, auto_ack=True)
                if method is None:
                    break
                message = json.loads(body)
                self.taken[message["message_id"]] = message
        finally:
            connection.close()
        wanted = {str(job_id) for job_id in job_ids}
        return {key: value for key, value in self.taken.items() if key in wanted}

    def refused(self, job: models.StagedJob) -> models.StagedJob:
        return dataclasses.replace(job, job_name="os.system")

    def unrouted(self, job: models.StagedJob) -> models.StagedJob | None:
        return None  # the adapter declares each queue before its first publish

    def build_down(self) -> Adapter:
        return self._build(f"amqp://guest:guest@127.0.0.1:{faultload.free_port()}/%2F", 2)

    def broker(self) -> tuple[str, int] | None:
        parts = urllib.parse.urlsplit(rabbit.SHARED_URL)
        return parts.hostname or "127.0.0.1", parts.port or 5672

    def build_at(self, port: int) -> Adapter:
        return self._build(f"amqp://guest:guest@127.0.0.1:{port}/%2F", 2)


class NatsHarness:
    """NATS JetStream: a stream of the test's own covers exactly ``<prefix>.<queue>``; a job of
    another queue has a subject no stream covers (unroutable)."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self.queue = "contract"

    def options(self, url: str = jetstream.SHARED_URL) -> dict[str, Any]:
        return {"url": url, "subject_prefix": self.stream}

    def build(self) -> Adapter:
        from drain_adapters import nats

        return nats.NatsAdapter.from_options(NAME, self.options(), publish_timeout_s=30)

    def held(self, job_ids: list[uuid.UUID]) -> dict[str, Any]:
        wanted = {str(job_id) for job_id in job_ids}
        found = {json.loads(message.data)["job_id"]: message for message in jetstream.messages(self.stream)}
        return {key: value for key, value in found.items() if key in wanted}

    def refused(self, job: models.StagedJob) -> models.StagedJob:
        return dataclasses.replace(job, queue="no subject")  # a space: no valid subject

    def unrouted(self, job: models.StagedJob) -> models.StagedJob | None:
        return dataclasses.replace(job, queue="nowhere")  # no stream covers it

    def build_down(self) -> Adapter:
        from drain_adapters import nats

        url = f"nats://127.0.0.1:{faultload.free_port()}"
        return nats.NatsAdapter.from_options(NAME, self.options(url), publish_timeout_s=2)

    def broker(self) -> tuple[str, int] | None:
        parts = urllib.parse.urlsplit(jetstream.SHARED_URL)
        return parts.hostname or "127.0.0.1", parts.port or 4222

    def build_at(self, port: int) -> Adapter:
        from drain_adapters import nats

        return nats.NatsAdapter.from_options(
            NAME, self.options(f"nats://127.0.0.1:{port}"), publish_timeout_s=2
        )


@pytest.fixture(params=["memory", "rq", "rabbitmq", "celery", "dramatiq-redis", "dramatiq-amqp", "nats"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    if request.param == "memory":
        yield MemoryHarness()
    elif request.param == "rq":
        yield RQHarness(request.getfixturevalue("redis_db"))
    elif request.param == "dramatiq-redis":
        yield DramatiqRedisHarness(request.getfixturevalue("redis_db"))
    elif request.param == "dramatiq-amqp":
        rabbit.need_rabbitmq()
        queue = rabbit.unique_name("contract")
        try:
            yield DramatiqAmqpHarness(queue)
        finally:
            rabbit.delete_queues(rabbit.SHARED_URL, queue, f"{queue}.DQ", f"{queue}.XQ")
    elif request.param == "nats":
        jetstream.need_nats()
        name = jetstream.unique_name("CONTRACT")
        with jetstream.stream(name, [f"{name}.contract"]):
            yield NatsHarness(name)
    elif request.param == "celery":
        rabbit.need_rabbitmq()
        with rabbit.queues(rabbit.SHARED_URL, rabbit.unique_name("contract")) as (queue,):
            yield CeleryHarness(queue)
    else:
        rabbit.need_rabbitmq()
        with rabbit.queues(rabbit.SHARED_URL, rabbit.unique_name("contract")) as (queue,):
            yield RabbitMQHarness(queue)


@pytest.fixture
def adapter(harness: Harness) -> Iterator[Adapter]:
    built = harness.build()
    built.open()
    yield built
    built.close()


def by_row(results: Any) -> dict[int, models.PublishResult]:
    return {result.row_id: result for result in results}


def test_exactly_one_result_per_job(harness: Harness, adapter: Adapter) -> None:
    jobs = [make_job(i, harness.queue) for i in range(1, 301)]
    jobs[7] = harness.refused(jobs[7])
    results = list(adapter.publish_batch(jobs))
    assert sorted(result.row_id for result in results) == [job.id for job in jobs]


def test_published_can_be_read_back_by_job_id(harness: Harness, adapter: Adapter) -> None:
    jobs = [make_job(i, harness.queue) for i in range(1, 51)]
    results = by_row(adapter.publish_batch(jobs))
    assert {result.outcome for result in results.values()} == {models.Outcome.PUBLISHED}
    held = harness.held([job.job_id for job in jobs])
    assert set(held) == {str(job.job_id) for job in jobs}


def test_a_job_refused_for_its_own_data_is_rejected_and_the_rest_published(
    harness: Harness, adapter: Adapter
) -> None:
    jobs = [make_job(i, harness.queue) for i in range(1, 21)]
    bad = harness.refused(jobs[4])
    jobs[4] = bad
    results = by_row(adapter.publish_batch(jobs))
    assert results[bad.id].outcome is models.Outcome.REJECTED
    assert results[bad.id].error
    good = [job for job in jobs if job.id != bad.id]
    assert all(results[job.id].outcome is models.Outcome.PUBLISHED for job in good)
    held = harness.held([job.job_id for job in jobs])
    assert set(held) == {str(job.job_id) for job in good}


def test_a_job_whose_queue_has_no_route_waits_uncounted_and_the_rest_published(
    harness: Harness, adapter: Adapter
) -> None:
    """No route is the queue's fault (every job of it meets it), never the job's: RETRY, no
    attempt counted (issue 33: each was dead-lettered after max_attempts)."""
    jobs = [make_job(i, harness.queue) for i in range(1, 21)]
    lost = harness.unrouted(jobs[4])
    if lost is None:
        pytest.skip("this backend's queues need no route")
    jobs[4] = lost
    results = by_row(adapter.publish_batch(jobs))
    assert results[lost.id].outcome is models.Outcome.RETRY, results[lost.id]
    assert all(results[job.id].outcome is models.Outcome.PUBLISHED for job in jobs if job is not lost)


@pytest.mark.parametrize("line_break", ["\n", "\r"])
def test_a_job_whose_queue_holds_a_line_break_is_rejected_on_amqp_and_the_rest_published(
    harness: Harness, adapter: Adapter, line_break: str
) -> None:
    """RabbitMQ strips CR and LF from the queue names it declares: no queue has such a name, so
    that job is refused for its own data. Before, pika waited for ever on the declare-ok (it
    came back under the stripped name), Celery declared the stripped queue and then waited on
    NO_ROUTE for ever, and the RabbitMQ backend retried on NO_ROUTE for ever."""
    if not isinstance(harness, (RabbitMQHarness, CeleryHarness, DramatiqAmqpHarness)):
        pytest.skip("an AMQP rule")
    jobs = [make_job(i, harness.queue) for i in range(1, 21)]
    bad = dataclasses.replace(jobs[4], queue=f"{harness.queue}{line_break}x")
    jobs[4] = bad
    results = by_row(adapter.publish_batch(jobs))
    assert results[bad.id].outcome is models.Outcome.REJECTED, results[bad.id]
    assert "line break" in (results[bad.id].error or "") or "no Dramatiq queue name" in (
        results[bad.id].error or ""
    )
    good = [job for job in jobs if job.id != bad.id]
    assert all(results[job.id].outcome is models.Outcome.PUBLISHED for job in good)
    adapter.ping()  # the backend is up


def test_an_unreachable_broker_raises_unavailable(harness: Harness) -> None:
    down = harness.build_down()
    jobs = [make_job(i, harness.queue) for i in range(1, 6)]
    with pytest.raises(errors.BackendUnavailable):
        down.open()
        down.publish_batch(jobs)
    down.close()


def test_a_broker_lost_after_open_is_unavailable_until_it_is_back(harness: Harness) -> None:
    """No PUBLISHED result while the broker is gone; the same adapter publishes once it is back."""
    target = harness.broker()
    if target is None:
        pytest.skip("no broker to lose")
    path = proxy.Proxy(*target)
    adapter = harness.build_at(path.port)
    try:
        adapter.open()
        path.set(proxy.CUT)
        with pytest.raises(errors.BackendUnavailable):
            adapter.publish_batch([make_job(i, harness.queue) for i in range(1, 6)])
        path.set(proxy.PASS)
        adapter.close()  # what the relay does with a backend it pauses, then it opens it again
        adapter.open()
        jobs = [make_job(i, harness.queue) for i in range(6, 11)]
        results = by_row(adapter.publish_batch(jobs))
        assert {result.outcome for result in results.values()} == {models.Outcome.PUBLISHED}
        assert set(harness.held([job.job_id for job in jobs])) == {str(job.job_id) for job in jobs}
    finally:
        adapter.close()
        path.close()


def test_close_twice_is_harmless(harness: Harness) -> None:
    built = harness.build()
    built.close()
    built.open()
    built.close()
    built.close()


def test_reopen_after_close_works(harness: Harness, adapter: Adapter) -> None:
    first = make_job(1, harness.queue)
    assert adapter.publish_batch([first])[0].outcome is models.Outcome.PUBLISHED
    adapter.close()
    adapter.open()
    adapter.ping()
    second = make_job(2, harness.queue)
    assert adapter.publish_batch([second])[0].outcome is models.Outcome.PUBLISHED
    held = harness.held([first.job_id, second.job_id])
    assert set(held) == {str(first.job_id), str(second.job_id)}


def test_pipelined_batches_outstanding_together_each_get_their_own_results(
    harness: Harness, adapter: Adapter
) -> None:
    if not isinstance(adapter, PipelinedAdapter):
        pytest.skip("this backend answers each batch at once (no submit/collect)")
    batches = [[make_job(100 * b + i, harness.queue) for i in range(1, 41)] for b in range(3)]
    batches[1][3] = harness.refused(batches[1][3])
    tickets = [adapter.submit(batch) for batch in batches]
    for batch, ticket in zip(batches, tickets, strict=True):
        results = by_row(adapter.collect(ticket))
        assert sorted(results) == [job.id for job in batch]
        for job in batch:
            expected = models.Outcome.REJECTED if job is batches[1][3] else models.Outcome.PUBLISHED
            assert results[job.id].outcome is expected
    jobs = [job for batch in batches for job in batch]
    held = harness.held([job.job_id for job in jobs])
    assert set(held) == {str(job.job_id) for job in jobs if job is not batches[1][3]}


def established_to(port: int) -> bool:
    """Whether a TCP connection of this machine to ``port`` on loopback is still established
    (from /proc: once the proxy cuts it, the client's side waits in CLOSE_WAIT)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
            return True
    return False


def test_a_batch_lost_with_its_connection_retries_once_a_new_one_carries_the_next(
    harness: Harness,
) -> None:
    """A pipelined batch whose connection died before any confirm came, collected after the next
    batch went out on a new connection: its jobs RETRY (the broker may hold them or not), and the
    backend is not unavailable, which would drop the new connection with the batch on it (issue
    33, item 4: the relay collects such a batch steps later, after it reconnected)."""
    target = harness.broker()
    if target is None:
        pytest.skip("no broker to lose")
    path = proxy.Proxy(*target)
    adapter = harness.build_at(path.port)
    try:
        if not isinstance(adapter, PipelinedAdapter) or not getattr(harness, "keeps_in_flight", True):
            pytest.skip("this backend answers each batch at once (nothing stays in flight)")
        adapter.open()
        first = adapter.publish_batch([make_job(100, harness.queue)])  # Celery declares the queue
        assert first[0].outcome is models.Outcome.PUBLISHED
        path.set(proxy.BLACKHOLE)  # no confirm comes back
        lost = [make_job(i, harness.queue) for i in range(1, 6)]
        ticket = adapter.submit(lost)
        path.set(proxy.CUT)
        wait_until("the proxy to cut the connection", lambda: not established_to(path.port), 10)
        path.set(proxy.PASS)
        later = [make_job(i, harness.queue) for i in range(6, 11)]
        second = adapter.submit(later)  # notices the loss and connects again
        results = by_row(adapter.collect(ticket))
        assert sorted(results) == [job.id for job in lost]
        assert {result.outcome for result in results.values()} == {models.Outcome.RETRY}
        published = by_row(adapter.collect(second))
        assert {result.outcome for result in published.values()} == {models.Outcome.PUBLISHED}
        assert set(harness.held([job.job_id for job in later])) == {str(job.job_id) for job in later}
    finally:
        adapter.close()
        path.close()


def test_collect_after_close_returns_at_once(harness: Harness) -> None:
    """The relay closes a backend it found unavailable, then collects its other batches in flight
    for what they hold: that collect must not wait for confirms that cannot come any more."""
    target = harness.broker()
    if target is None:
        pytest.skip("no broker to lose")
    path = proxy.Proxy(*target)
    adapter = harness.build_at(path.port)
    try:
        if not isinstance(adapter, PipelinedAdapter) or not getattr(harness, "keeps_in_flight", True):
            pytest.skip("this backend answers each batch at once (nothing stays in flight)")
        adapter.open()
        adapter.publish_batch([make_job(100, harness.queue)])  # Celery declares the queue
        path.set(proxy.BLACKHOLE)  # no confirm comes back
        ticket = adapter.submit([make_job(i, harness.queue) for i in range(1, 6)])
        path.set(proxy.CUT)
        adapter.close()
        started = time.monotonic()
        with pytest.raises(errors.BackendUnavailable):  # nothing of it was confirmed
            adapter.collect(ticket)
        assert time.monotonic() - started < 1.0
    finally:
        adapter.close()
        path.close()
