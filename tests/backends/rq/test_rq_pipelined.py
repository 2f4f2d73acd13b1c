"""G1 G4: the RQ backend's pipelined batches (``submit`` now, ``collect`` a step later).

In a backlog the relay sends a full batch's script call on the adapter's own connection and
reads the reply after its next select, so several batches can be in flight on one connection.
Each reply must answer its own batch and nothing else, whatever happens between the send and the
read: Redis forgot the script (restart, failover: NOSCRIPT for every call in flight), the
connection was lost, the adapter was closed and opened again, or a replica acknowledged nothing
(``wait_replicas``: ``WAIT`` is sent right behind the call, on the same connection).

A private redis-server: these tests flush its scripts and stop its replica.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from drain_adapters.rq import adapter as rq_adapter
from drain_adapters.rq import message as rq_message
from drain_adapters.rq import script as rq_script

from drain import errors, models
from tests.support import jobs, redis_server

QUEUE = "pipelined"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis_server.RedisServer]:
    with redis_server.running(tmp_path_factory.mktemp("redis"), appendonly=False) as private:
        yield private


def adapter_for(url: str, **options: object) -> rq_adapter.RQAdapter:
    settings = {"url": url, "allowed_jobs": ["json.dumps"], "socket_timeout_s": 3.0, **options}
    return rq_adapter.RQAdapter.from_options("default", settings, publish_timeout_s=5)


def batches(first_id: int, count: int, size: int) -> list[list[models.StagedJob]]:
    return [[jobs.staged(first_id + size * b + i, QUEUE) for i in range(size)] for b in range(count)]


def outcomes(results: list[models.PublishResult]) -> set[models.Outcome]:
    return {result.outcome for result in results}


def queued(server: redis_server.RedisServer) -> list[bytes]:
    with contextlib.closing(server.client()) as client:
        return client.lrange(rq_message.queue_key(QUEUE), 0, -1)


@pytest.fixture(autouse=True)
def empty(server: redis_server.RedisServer) -> Iterator[None]:
    yield
    with contextlib.closing(server.client()) as client:
        client.flushdb()


def test_every_batch_in_flight_is_run_again_when_redis_forgot_the_script(
    server: redis_server.RedisServer,
) -> None:
    """Three batches in flight meet NOSCRIPT (the script cache flushed before they went): each
    is given the script again and published, once, in its own order."""
    adapter = adapter_for(server.url)
    adapter.open()
    try:
        with contextlib.closing(server.client()) as client:
            client.script_flush()
        sent = batches(1, 3, 20)
        tickets = [adapter.submit(batch) for batch in sent]
        for ticket in tickets:
            assert outcomes(list(adapter.collect(ticket))) == {models.Outcome.PUBLISHED}
    finally:
        adapter.close()
    expected = [str(job.job_id).encode() for batch in sent for job in batch]
    assert queued(server) == expected


def test_a_ticket_of_a_closed_adapter_is_never_answered_by_the_new_connection(
    server: redis_server.RedisServer,
) -> None:
    """Closed and opened again (what the relay does after an outage), the adapter's new
    connection carries new batches: a ticket sent before the close is unavailable, never
    handed a reply that belongs to a later batch (that would settle rows Redis may not hold)."""
    adapter = adapter_for(server.url)
    adapter.open()
    try:
        old = adapter.submit(batches(1, 1, 5)[0])
        adapter.close()
        adapter.open()
        new = adapter.submit(batches(100, 1, 5)[0])
        with pytest.raises(errors.BackendUnavailable):
            adapter.collect(old)
        assert outcomes(list(adapter.collect(new))) == {models.Outcome.PUBLISHED}
    finally:
        adapter.close()


def test_a_refused_job_stops_its_flights_script_and_the_rest_go_again_in_order(
    server: redis_server.RedisServer,
) -> None:
    """A job whose own write Redis refuses (its queue key holds a string: the queue's fault)
    stops the script; the jobs after it in that batch go again, and a batch sent behind it is
    answered with its own replies."""
    adapter = adapter_for(server.url)
    adapter.open()
    try:
        first, second = batches(1, 2, 6)
        first[2] = jobs.staged(1000, "wrong-type")
        with contextlib.closing(server.client()) as client:
            client.set(rq_message.queue_key("wrong-type"), b"not a list")
        tickets = [adapter.submit(first), adapter.submit(second)]
        results = [{r.row_id: r.outcome for r in adapter.collect(ticket)} for ticket in tickets]
    finally:
        adapter.close()
    assert results[0] == {
        job.id: models.Outcome.RETRY if job is first[2] else models.Outcome.PUBLISHED for job in first
    }
    assert set(results[1].values()) == {models.Outcome.PUBLISHED}
    assert len(results[1]) == len(second)
    assert len(queued(server)) == len(first) - 1 + len(second)


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[tuple[redis_server.RedisServer, redis_server.RedisServer]]:
    with redis_server.replicated(tmp_path) as pair:
        yield pair


def test_a_flight_is_acknowledged_only_once_a_replica_has_it(
    replicated: tuple[redis_server.RedisServer, redis_server.RedisServer],
) -> None:
    """``wait_replicas = 1`` with the replica frozen: each flight's WAIT times out, so its
    collect is unavailable (the rows wait). Once the replica is back, the same jobs go again on a
    new connection and are acknowledged, without a duplicate."""
    master, replica = replicated
    assert replica.process is not None
    adapter = adapter_for(master.url, wait_replicas=1, wait_timeout_s=0.3)
    sent = batches(1, 2, 5)
    with contextlib.closing(master.client()) as client:
        client.script_load(rq_script.SCRIPT)  # else NOSCRIPT: the batch runs again on the link
    replica.process.send_signal(signal.SIGSTOP)  # online for its master, acknowledging nothing
    try:
        adapter.open()
        tickets = [adapter.submit(batch) for batch in sent]
        with pytest.raises(errors.BackendUnavailable, match="wait_replicas"):
            adapter.collect(tickets[0])
        adapter.close()  # what the relay does with a backend found unavailable
    finally:
        replica.process.send_signal(signal.SIGCONT)
    adapter.open()
    try:
        tickets = [adapter.submit(batch) for batch in sent]
        for ticket in tickets:
            assert outcomes(list(adapter.collect(ticket))) == {models.Outcome.PUBLISHED}
    finally:
        adapter.close()
    with contextlib.closing(replica.client()) as on_replica:
        held = on_replica.lrange(rq_message.queue_key(QUEUE), 0, -1)
    assert held == [str(job.job_id).encode() for batch in sent for job in batch], "each once, in order"
