"""The adapter contract (drain.backend.Adapter), one suite run against every backend.

Each backend gives a harness: build an adapter, read back what the broker holds by job id, make a
job unroutable, and build an adapter whose broker is unreachable (a closed loopback port).
Real brokers are the machine's shared ones, used through a Redis db index or queues of the test's
own.
"""

from __future__ import annotations

import dataclasses
import datetime
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

import pytest

from drain import errors, models, testing
from drain.backend import Adapter, PipelinedAdapter
from tests.support import faultload, proxy, rabbit

NAME = "contract"


class Harness(Protocol):
    queue: str

    def build(self) -> Adapter: ...

    def held(self, job_ids: list[uuid.UUID]) -> dict[str, Any]:
        """The job ids (as strings) the broker holds, among ``job_ids``, with what it holds."""
        ...

    def unroutable(self, job: models.StagedJob) -> models.StagedJob: ...

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

    def unroutable(self, job: models.StagedJob) -> models.StagedJob:
        return dataclasses.replace(job, job_name="unroutable")

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

    def unroutable(self, job: models.StagedJob) -> models.StagedJob:
        return dataclasses.replace(job, job_name="os.system")

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

    def unroutable(self, job: models.StagedJob) -> models.StagedJob:
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
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(rabbit.SHARED_URL))
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

    def unroutable(self, job: models.StagedJob) -> models.StagedJob:
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


@pytest.fixture(params=["memory", "rq", "rabbitmq", "celery"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    if request.param == "memory":
        yield MemoryHarness()
    elif request.param == "rq":
        yield RQHarness(request.getfixturevalue("redis_db"))
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
    jobs[7] = harness.unroutable(jobs[7])
    results = list(adapter.publish_batch(jobs))
    assert sorted(result.row_id for result in results) == [job.id for job in jobs]


def test_published_can_be_read_back_by_job_id(harness: Harness, adapter: Adapter) -> None:
    jobs = [make_job(i, harness.queue) for i in range(1, 51)]
    results = by_row(adapter.publish_batch(jobs))
    assert {result.outcome for result in results.values()} == {models.Outcome.PUBLISHED}
    held = harness.held([job.job_id for job in jobs])
    assert set(held) == {str(job.job_id) for job in jobs}


def test_unroutable_job_is_rejected_and_the_rest_published(harness: Harness, adapter: Adapter) -> None:
    jobs = [make_job(i, harness.queue) for i in range(1, 21)]
    bad = harness.unroutable(jobs[4])
    jobs[4] = bad
    results = by_row(adapter.publish_batch(jobs))
    assert results[bad.id].outcome is models.Outcome.REJECTED
    assert results[bad.id].error
    good = [job for job in jobs if job.id != bad.id]
    assert all(results[job.id].outcome is models.Outcome.PUBLISHED for job in good)
    held = harness.held([job.job_id for job in jobs])
    assert set(held) == {str(job.job_id) for job in good}


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
    batches[1][3] = harness.unroutable(batches[1][3])
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
