"""Red team (G6+ through the new backends): whatever a row holds, a real NATS JetStream server and
Dramatiq's own decoder see only well-formed messages, and each row is published or refused alone.

Hypothesis draws rows with hostile queues, job names, ordering keys, ``headers`` options and
arguments (CR LF, NUL, spaces, the subject wildcards ``*`` and ``>``, dots, ``Nats-...`` header
names in any case, lone surrogates, long values), mixed with good rows, and hands them to the
adapter as one batch:

- NATS (a stream of the test's own on the shared server, subjects ``<prefix>.>``): every row is
  PUBLISHED or REJECTED with a reason, nothing raises; the stream holds exactly the published
  rows, once each, each on ``<prefix>.<its queue>`` with ``Nats-Msg-Id`` = its job id and row id and no other
  ``Nats-`` header; the stream was never purged or rolled up (its first sequence is 1).
- Dramatiq on Redis (a Redis db of the test's own): every row PUBLISHED or REJECTED; every key
  written is ``dramatiq:<queue>`` or ``dramatiq:<queue>.msgs`` of a published row; every message
  decodes with ``dramatiq.Message.decode`` to the row's actor, queue and job id.

This held on the current code for the examples drawn (the key collisions of
test_redteam_dramatiq_keys.py are excluded here: they are reported there)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

import pytest
import redis
from drain_adapters import dramatiq, nats
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drain import models
from tests.support import jetstream, jobs

ACTOR = "app.record"
TRICKY = [
    "",
    " ",
    "a b",
    "a\r\nb",
    "a\nPUB x 1\r\n",
    "\r\nNats-Rollup: all",
    "x\x00y",
    "*",
    ">",
    "a.*",
    "a.>",
    "a..b",
    ".a",
    "a.",
    "\ud800",
    "é",
    "\u2028",
    "\x85",
    "\t",
    "Nats-Msg-Id",
    "a" * 5000,
]
TEXT = st.one_of(st.sampled_from(TRICKY), st.text(st.characters(exclude_categories=["Cs"]), max_size=30))
HEADER_NAMES = st.one_of(
    st.sampled_from(
        ["Nats-Rollup", "nats-msg-id", "NATS-EXPECTED-STREAM", "Drain-Job-Name", "x:y", "a b", ""]
    ),
    TEXT,
)
OPTIONS: st.SearchStrategy[dict[str, Any]] = st.one_of(
    st.just({}),
    st.dictionaries(HEADER_NAMES, st.one_of(TEXT, st.integers(), st.booleans()), max_size=3).map(
        lambda headers: {"headers": headers}
    ),
    st.dictionaries(TEXT, TEXT, max_size=2),
)


@st.composite
def hostile_row(draw: st.DrawFn, row_id: int) -> models.StagedJob:
    job = jobs.staged(row_id, "ok", ACTOR)
    return dataclasses.replace(
        job,
        queue=draw(st.one_of(st.just("ok"), TEXT)),
        job_name=draw(st.one_of(st.just(ACTOR), TEXT.filter(bool))),
        ordering_key=draw(st.one_of(st.none(), TEXT.filter(bool))),
        options=draw(OPTIONS),
        args=[draw(TEXT)],
        kwargs={draw(TEXT): draw(TEXT)},
    )


@st.composite
def batches(draw: st.DrawFn) -> list[models.StagedJob]:
    count = draw(st.integers(1, 6))
    hostile = [draw(hostile_row(row_id)) for row_id in range(1, count + 1)]
    good = [jobs.staged(row_id, "ok", ACTOR) for row_id in range(100, 104)]
    return draw(st.permutations(hostile + good))


def check_results(batch: list[models.StagedJob], results: list[models.PublishResult]) -> set[int]:
    by_row = {result.row_id: result for result in results}
    assert set(by_row) == {job.id for job in batch}
    for job in batch:
        result = by_row[job.id]
        assert result.outcome in (models.Outcome.PUBLISHED, models.Outcome.REJECTED), result
        if result.outcome is models.Outcome.REJECTED:
            assert result.error, result
        if job.id >= 100:
            assert result.outcome is models.Outcome.PUBLISHED, result
    return {row for row, result in by_row.items() if result.outcome is models.Outcome.PUBLISHED}


@pytest.mark.slow
def test_nats_any_row_is_published_alone_or_refused_never_injected() -> None:
    jetstream.need_nats()
    prefix = jetstream.unique_name("RTROWS")
    with jetstream.stream(prefix, [f"{prefix}.>"]):
        adapter = nats.NatsAdapter.from_options(
            "t", {"url": jetstream.SHARED_URL, "subject_prefix": prefix}, publish_timeout_s=5
        )
        adapter.open()
        sent: dict[str, models.StagedJob] = {}

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(batches())
        def run(batch: list[models.StagedJob]) -> None:
            published = check_results(batch, adapter.publish_batch(batch))
            sent.update((str(job.job_id), job) for job in batch if job.id in published)

        try:
            run()
        finally:
            adapter.close()
        stored = jetstream.messages(prefix)
    assert stored[0].seq == 1, "the stream lost its first messages: purged or rolled up"
    assert len(stored) == len(sent), (len(stored), len(sent))
    for message in stored:
        job_id, _row = message.headers["Nats-Msg-Id"].split(":")
        job = sent[job_id]
        assert _row == str(job.id)
        assert message.subject == f"{prefix}.{job.queue}"
        assert json.loads(message.data)["job_id"] == job_id
        assert [name for name in message.headers if name.lower().startswith("nats-")] == ["Nats-Msg-Id"]


@pytest.mark.slow
def test_dramatiq_redis_any_row_is_published_alone_or_refused_and_decodes(redis_db: str) -> None:
    from dramatiq import Message

    # A namespace of its own: a db index once carried ``dramatiq:__heartbeats__``, written by another
    # test's worker after that test's keys were deleted.
    namespace = f"redteam-{uuid.uuid4().hex[:8]}"
    options = {"url": redis_db, "namespace": namespace}
    adapter = dramatiq.DramatiqAdapter.from_options("d", options, publish_timeout_s=5)
    adapter.open()
    client = redis.Redis.from_url(redis_db)
    sent: dict[str, models.StagedJob] = {}

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(batches())
    def run(batch: list[models.StagedJob]) -> None:
        batch = [job for job in batch if not job.queue.endswith(".msgs") and job.queue != "__heartbeats__"]
        published = check_results(batch, adapter.publish_batch(batch))
        sent.update((str(job.job_id), job) for job in batch if job.id in published)

    try:
        run()
        expected_keys = {f"{namespace}:{job.queue}" for job in sent.values()}
        expected_keys |= {f"{key}.msgs" for key in expected_keys}
        keys = {key.decode() for key in client.keys(f"{namespace}:*")}
        assert keys == expected_keys
        seen = 0
        for key in sorted(k for k in keys if k.endswith(".msgs")):
            for field, body in client.hgetall(key).items():
                message: Any = Message.decode(body)
                job = sent[message.message_id]
                assert field.decode() == f"{job.job_id}:{job.id}"
                assert (message.message_id, message.queue_name, message.actor_name) == (
                    str(job.job_id),
                    job.queue,
                    job.job_name,
                )
                seen += 1
        assert seen == len(sent)
    finally:
        adapter.close()
        client.close()
