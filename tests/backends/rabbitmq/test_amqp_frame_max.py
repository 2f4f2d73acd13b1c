"""A message's header frame is checked against the ``frame_max`` the broker negotiated on the
connection it is written on (G6): a private RabbitMQ configured with ``frame_max = 8192`` closes
the connection on a larger header frame, which would fail every job in flight, again on each
retry. Each backend rejects that one job instead, and delivers the good rows of its batch.

The RabbitMQ backend builds a batch before it (re)connects: the frame_max it built against may be
an earlier connection's, or the URL's 131072 before the first; ``submit`` checks again."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from drain_adapters import celery as celery_backend
from drain_adapters import rabbitmq

from drain import models
from tests.support import rabbit

FRAME_MAX = 8192
BIG = "x" * 20_000  # fits the default 131072, not 8192


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[rabbit.PrivateBroker]:
    base: Path = tmp_path_factory.mktemp("frame-max")
    with rabbit.private_broker(base, config=f"frame_max = {FRAME_MAX}\n") as started:
        yield started


def row(n: int, queue: str, **options: Any) -> models.StagedJob:
    return models.StagedJob(
        n,
        uuid.uuid4(),
        "app.tasks.x",
        [n],
        {},
        queue,
        "default",
        options,
        datetime.datetime.now(datetime.UTC),
    )


def outcomes(results: list[models.PublishResult]) -> dict[int, tuple[models.Outcome, str]]:
    return {r.row_id: (r.outcome, r.error or "") for r in results}


@pytest.mark.slow
def test_rabbitmq_rejects_a_header_over_the_negotiated_frame_max(broker: rabbit.PrivateBroker) -> None:
    queue = rabbit.unique_name("frame-max")
    with rabbit.queues(broker.url, queue):
        adapter = rabbitmq.RabbitMQAdapter.from_options("frames", {"url": broker.url}, publish_timeout_s=5)
        try:  # not opened: the first submit connects
            results = outcomes(
                adapter.publish_batch([row(1, queue), row(2, queue, headers={"h": BIG}), row(3, queue)])
            )
        finally:
            adapter.close()
        held = rabbit.take_all(broker.url, queue)
    assert results[1][0] is results[3][0] is models.Outcome.PUBLISHED, results
    assert results[2][0] is models.Outcome.REJECTED and f"frame_max {FRAME_MAX}" in results[2][1], results
    assert len(held) == 2


@pytest.mark.slow
def test_celery_rejects_a_header_over_the_negotiated_frame_max(broker: rabbit.PrivateBroker) -> None:
    queue = rabbit.unique_name("frame-max")
    url = broker.url.replace("/%2F", "//")
    with rabbit.queues(broker.url, queue):
        adapter = celery_backend.CeleryAdapter.from_options(
            "frames", {"broker_url": url, "allowed_jobs": ["app.**"]}, publish_timeout_s=5
        )
        adapter.open()
        try:
            results = outcomes(
                adapter.publish_batch([row(1, queue), row(2, queue, shadow=BIG), row(3, queue)])
            )
        finally:
            adapter.close()
        held = rabbit.take_counts(broker.url, (queue,), by="correlation_id")
    assert results[1][0] is results[3][0] is models.Outcome.PUBLISHED, results
    assert results[2][0] is models.Outcome.REJECTED and f"frame_max {FRAME_MAX}" in results[2][1], results
    assert sum(held.values()) == 2
