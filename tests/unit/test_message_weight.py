"""A row's weight (drain.store.reading.weight) covers what its job costs the drain while its batch is
sent, for every backend and whatever its text: the decoded job and its message as the batch holds
them stay within the weight, and building the message (the encoder's copies, one message at a
time) peaks within BUILD_PEAK x the weight (tracemalloc). The README's memory bound, base + 3 x
batch_max_bytes, rests on this: the rows of the batches in flight weigh at most batch_max_bytes.

Non-ASCII text is where a weight of 4 bytes per byte of text fell short: every backend's JSON
escapes ``é`` (2 bytes of UTF-8, 1 in a Python string) to the 6 bytes ``\\u00e9``, and Celery on
Redis base64-encodes that inside a JSON envelope; one astral character makes a whole string 4
bytes a character. Before, a batch of such rows held up to 3.3 times its weight (Celery on
Redis), and ``bench_memory.py --text unicode`` peaked over the README's bound."""

from __future__ import annotations

import datetime
import gc
import json
import sys
import tracemalloc
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from drain_adapters.celery import amqp_publisher as celery_amqp
from drain_adapters.celery import message as celery_message
from drain_adapters.celery import redis_publisher as celery_redis
from drain_adapters.rabbitmq import messages as rabbitmq_messages

from drain import models
from drain.store import reading

NOW = datetime.datetime(2024, 5, 1, tzinfo=datetime.UTC)
CHARS = 200_000
BUILD_PEAK = 2.5
APP = celery_message.new_app()

TEXTS = {
    "ASCII": json.dumps(["a" * CHARS]),
    "Latin-1": json.dumps(["é" * CHARS], ensure_ascii=False),
    "CJK": json.dumps(["中" * CHARS], ensure_ascii=False),
    "emoji": json.dumps(["😀" * CHARS], ensure_ascii=False),
    "ASCII and one emoji": json.dumps(["a" * CHARS + "😀"], ensure_ascii=False),
    "non-ASCII members": json.dumps([{"é": "ü", "k": "中"} for _ in range(CHARS // 20)], ensure_ascii=False),
}


def celery_on_redis(job: models.StagedJob) -> Any:
    return celery_redis.wire(celery_message.build(APP, job, reply_to="r", now=NOW))


BACKENDS: dict[str, Callable[[models.StagedJob], Any]] = {
    "rabbitmq": lambda job: rabbitmq_messages.build(job, max_body_bytes=1 << 30, frame_max=131_072),
    "celery on amqp": lambda job: celery_amqp.wire(celery_message.build(APP, job, reply_to="r", now=NOW)),
    "celery on redis": celery_on_redis,
}


def select_due_row(args: str) -> tuple[Any, ...]:
    names = ("app.tasks.x", "default", "default")
    row_bytes = sum(len(text.encode()) for text in (args, "{}", "{}", *names))
    return (1, uuid.uuid4(), 0, row_bytes, True, *names, args, "{}", "{}", NOW, None, None, 0.1, None)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("text", list(TEXTS))
def test_a_rows_job_and_message_stay_within_its_weight(text: str, backend: str) -> None:
    warm_up = select_due_row("[1]")  # a backend's lazy imports are no row's cost
    BACKENDS[backend](reading.decode(warm_up, 1.0))
    row = select_due_row(TEXTS[text])
    weight = reading.weight(row)
    gc.collect()
    tracemalloc.start()
    try:
        job = reading.decode(row, 1.0, weight)
        message = BACKENDS[backend](job)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    text_bytes = sys.getsizeof(row[reading.ARGS])  # the row's text: the batch holds it too
    assert message is not None
    assert held + text_bytes <= weight, f"holds {(held + text_bytes) / weight:.2f} x its weight"
    assert peak + text_bytes <= BUILD_PEAK * weight, f"peaks at {(peak + text_bytes) / weight:.2f} x"
