"""Whatever a row holds, the NATS backend answers it alone (G6+), on the real server: Hypothesis
generates rows with any text in the queue, the job name and the ordering key, options of any
shape, arguments of any JSON (NaN and infinities too) and sizes around the server's max_payload,
and publishes each beside a good row. Each row is published (and then in the stream exactly
once) or rejected with a reason; the good row is always published; nothing is an outage, and no
row breaks the connection for the next batch."""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
from drain_adapters import nats
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drain import models
from tests.support import jetstream, jobs

ANY_TEXT = st.text(st.characters(codec="utf-8"), max_size=20) | st.text(max_size=5)
JSON_LEAF = st.none() | st.booleans() | st.integers() | st.floats() | ANY_TEXT
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3),
    max_leaves=8,
)
HEADERS = st.dictionaries(
    ANY_TEXT | st.sampled_from(["Nats-Rollup", "Drain-Job-Name", "x-ordering-key"]), JSON, max_size=3
)
OPTIONS = st.dictionaries(st.sampled_from(["headers", "priority", "ttl"]), HEADERS | JSON, max_size=2)
SIZES = st.sampled_from([0, 1_000, 1_048_000, 1_048_576, 1_100_000])


@st.composite
def hostile(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "queue": draw(
            st.just("fine") | ANY_TEXT | st.sampled_from(["a.b", "a..b", "a.*", ">", " ", "q\r\nPUB x 0"])
        ),
        "job_name": draw(st.just("app.tasks.x") | ANY_TEXT),
        "ordering_key": draw(st.none() | ANY_TEXT.filter(bool)),
        "options": draw(st.just({}) | OPTIONS),
        "args": [draw(JSON), "x" * draw(SIZES)],
    }


@pytest.fixture(scope="module")
def stream() -> Iterator[str]:
    jetstream.need_nats()
    name = jetstream.unique_name("HOSTILE")
    with jetstream.stream(name, [f"{name}.>"]):
        yield name


@pytest.fixture(scope="module")
def adapter(stream: str) -> Iterator[nats.NatsAdapter]:
    built = nats.NatsAdapter.from_options(
        "hostile", {"url": jetstream.SHARED_URL, "subject_prefix": stream}, publish_timeout_s=10
    )
    built.open()
    yield built
    built.close()


PUBLISHED: list[models.StagedJob] = []


@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(rows=st.lists(hostile(), min_size=1, max_size=3))
def test_each_row_is_published_or_rejected_alone(
    adapter: nats.NatsAdapter, rows: list[dict[str, Any]]
) -> None:
    batch = [dataclasses.replace(jobs.staged(n, "fine"), **row) for n, row in enumerate(rows, start=1)]
    good = jobs.staged(len(rows) + 1, "good")
    results = {result.row_id: result for result in adapter.publish_batch([*batch, good])}
    assert sorted(results) == [job.id for job in [*batch, good]]
    assert results[good.id].outcome is models.Outcome.PUBLISHED, results[good.id]
    for job in batch:
        result = results[job.id]
        assert result.outcome in (models.Outcome.PUBLISHED, models.Outcome.REJECTED), result
        if result.outcome is models.Outcome.REJECTED:
            assert result.error
    PUBLISHED.extend(job for job in [*batch, good] if results[job.id].outcome is models.Outcome.PUBLISHED)


def test_what_was_published_is_in_the_stream_once(stream: str) -> None:
    if not PUBLISHED:
        pytest.skip("the property ran alone or not at all")
    held = collections.Counter(json.loads(message.data)["job_id"] for message in jetstream.messages(stream))
    assert {str(job.job_id) for job in PUBLISHED} == set(held)
    assert set(held.values()) == {1}
