"""A pipelined step whose broker goes dark with several batches in flight ends within one publish
timeout, and its session survives (reliability: bound the batch).

The RabbitMQ backend reaches the shared broker through a loopback proxy that blackholes it (the
sockets stay open, nothing is forwarded) while four batches await their confirms. The step that
collects them waits for the first batch's confirms up to ``publish_timeout_s``; the backend has
then failed for this step, so the other three get no result and no call — before, each one
reconnected into the blackhole (``connect_timeout_s`` each) until Postgres ended the session for
idle-in-transaction. No row is touched; after the heal every committed job reaches the broker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from drain import backend
from drain.relay import loop as relay
from drain.store import session as store
from tests.support import faultload, proxy, rabbit
from tests.support.waiting import wait_until

PUBLISH_TIMEOUT_S = 4.0  # connect_timeout_s defaults to it: four reconnects outlast the fence
BATCH = 50
DEPTH = 4
BACKEND = "rmq"


@pytest.fixture
def dark_path() -> Iterator[proxy.Proxy]:
    rabbit.need_rabbitmq()
    path = proxy.Proxy("127.0.0.1", 5672)
    try:
        yield path
    finally:
        path.close()


def test_a_broker_gone_dark_mid_pipeline_ends_the_step_within_one_publish_timeout(
    database: str, dark_path: proxy.Proxy
) -> None:
    names = (rabbit.unique_name("dark"),)
    url = f"amqp://guest:guest@127.0.0.1:{dark_path.port}/%2F"
    settings = rabbit.drain_settings(
        database,
        BACKEND,
        {"url": url},
        publish_timeout_s=PUBLISH_TIMEOUT_S,
        batch_size=BATCH,
        pipeline_depth=DEPTH,
    )
    fence_s = store.idle_in_transaction_timeout_ms(PUBLISH_TIMEOUT_S) / 1000
    with rabbit.queues(rabbit.SHARED_URL, *names):
        committed = rabbit.stage_jobs(database, BATCH * (DEPTH + 2), names, BACKEND)
        the_relay = relay.Relay(settings, backend.build_adapters(settings.backends, PUBLISH_TIMEOUT_S))
        try:
            assert the_relay.leadership.try_acquire()
            leader_pid = the_relay.leadership.pid
            assert the_relay.drain_once().published == BATCH  # connected, and confirms come back
            dark_path.set(proxy.BLACKHOLE)
            for _ in range(DEPTH):
                the_relay.drain_step()  # into the dark: no confirm comes back
            assert the_relay.in_flight == BATCH * DEPTH, "the batches were settled before the fault"

            started = time.monotonic()
            report = the_relay.settle_in_flight()  # collects all four: the first one times out
            step_s = time.monotonic() - started
            print(f"\n{DEPTH} batches in flight to a dark broker: step {step_s:.2f}s (fence {fence_s:.0f}s)")
            assert step_s < PUBLISH_TIMEOUT_S + 1.0 < fence_s, "a failed backend was waited for again"
            assert the_relay.leadership.pid == leader_pid  # the session survived: never fenced
            assert (report.published, report.skipped, the_relay.in_flight) == (0, BATCH * DEPTH, 0)
            left = len(committed) - BATCH
            assert faultload.scalar(database, "SELECT count(*) FROM staged_jobs") == left
            untouched = "SELECT count(*) FROM staged_jobs WHERE attempts = 0 AND run_at IS NULL"
            assert faultload.scalar(database, untouched) == left

            dark_path.set(proxy.PASS)

            def drained() -> bool:
                the_relay.drain_step()  # the backend stays paused for its backoff, then resumes
                return rabbit.staged_count(database) == 0 and not the_relay.in_flight

            wait_until("forwarding to resume after the heal", drained, 60)
            assert faultload.scalar(database, "SELECT count(*) FROM staged_jobs_dead") == 0
        finally:
            the_relay.shutdown()
        held = rabbit.take_counts(rabbit.SHARED_URL, names)
    lost = committed - set(held)
    assert not lost, f"{len(lost)} committed jobs lost"
    assert rabbit.staged_count(database) == 0
