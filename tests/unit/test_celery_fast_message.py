"""The drain's own protocol-2 builder (``celery_message.Protocol2``) makes, byte for byte, the
message Celery's ``as_task_v2`` and kombu's JSON serializer make, for any row; when it would not
(another Celery, a custom configuration) the probe says so and the adapter keeps Celery's builder."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import uuid
from typing import Any

import celery
import pytest
from celery.utils.saferepr import saferepr
from drain_adapters import celery as celery_backend
from drain_adapters.celery import message as celery_message
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from drain import backend, errors, models

NOW = datetime.datetime(2026, 1, 1, 12, 30, tzinfo=datetime.UTC)
APP = celery_message.new_app()

texts = st.one_of(
    st.text(max_size=12),
    st.text(alphabet="a '\\\"\n", max_size=12),  # quotes, a backslash, a space where truncate cuts
    st.sampled_from(["", "it's", "é\u2028\u2029\x00\x7f", "\U0001f600", "a" * 1030, "b " * 520]),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=False, allow_infinity=False),
    texts,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(texts, inner, max_size=5)),
    max_leaves=30,
)
header_names = st.text(min_size=1, max_size=10).filter(
    lambda name: name not in celery_message.PROTOCOL_HEADERS
)
option_values: dict[str, st.SearchStrategy[Any]] = {
    "priority": st.integers(0, celery_message.MAX_PRIORITY),
    "expires": st.one_of(
        st.integers(0, 10**6),
        st.floats(0, 10**6),
        st.sampled_from(["2030-01-01T00:00:00+02:00", "2020-05-05T10:00:00.123456+00:00"]),
    ),
    "time_limit": st.one_of(st.integers(0, 10**6), st.floats(0, 10**6)),
    "soft_time_limit": st.one_of(st.integers(0, 10**6), st.floats(0, 10**6)),
    "headers": st.dictionaries(header_names, json_values, max_size=4),
    "retries": st.integers(0, celery_message.MAX_RETRIES),
    "ignore_result": st.booleans(),
    "shadow": st.text(min_size=1, max_size=20),
}
assert set(option_values) == set(celery_message.KNOWN_OPTIONS)


@st.composite
def staged_jobs(draw: st.DrawFn) -> models.StagedJob:
    chosen = draw(st.lists(st.sampled_from(celery_message.KNOWN_OPTIONS), unique=True))
    traceparent = draw(st.none() | st.just("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"))
    return models.StagedJob(
        id=1,
        job_id=uuid.UUID(int=draw(st.integers(0, 2**128 - 1))),
        job_name=draw(st.sampled_from(["app.tasks.send", "tâche.é"])),
        args=draw(st.lists(json_values, max_size=6)),
        kwargs=draw(st.dictionaries(texts, json_values, max_size=6)),
        queue=draw(st.sampled_from(["mail", "file-d'attente"])),
        backend="default",
        options={key: draw(option_values[key]) for key in chosen},
        created_at=NOW,
        traceparent=traceparent,
        tracestate=draw(st.none() | st.just("k=v")) if traceparent else None,
        ordering_key=draw(st.none() | st.text(min_size=1, max_size=10)),
    )


def both_ways(app: celery.Celery, job: models.StagedJob) -> tuple[Any, Any]:
    """The drain's message and Celery's for ``job`` (or the exception each raised)."""
    outcomes: list[Any] = []
    for protocol in (celery_message.Protocol2.of(app), None):
        try:
            outcomes.append(celery_message.build(app, job, reply_to="reply", now=NOW, protocol=protocol))
        except Exception as exc:  # compared below
            outcomes.append((type(exc), str(exc)))
    return outcomes[0], outcomes[1]


def assert_same(ours: Any, celerys: Any) -> None:
    if isinstance(celerys, tuple):
        assert ours == celerys
        return
    assert isinstance(ours, celery_message.CeleryMessage)
    assert ours.body == celerys.body
    assert (ours.content_type, ours.content_encoding) == (celerys.content_type, celerys.content_encoding)
    # keys in the same order, values of the same types (30 is not 30.0 on the wire)
    assert repr(list(ours.headers.items())) == repr(list(celerys.headers.items()))
    assert repr(list(ours.properties.items())) == repr(list(celerys.properties.items()))
    assert (ours.routing_key, ours.exchange, ours.job) == (celerys.routing_key, celerys.exchange, celerys.job)
    assert celery_message.difference(ours, celerys) is None


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(staged_jobs())
@example(dataclasses.replace(celery_message._probe_jobs(1024)[0], args=[], kwargs={}))
@example(dataclasses.replace(celery_message._probe_jobs(1024)[0], args=[[[[[1]]]], {"a": {"b": {"c": {}}}}]))
@example(dataclasses.replace(celery_message._probe_jobs(1024)[0], args=[10**5000]))  # too long for str()
def test_the_drains_message_is_celerys(job: models.StagedJob) -> None:
    ours, celerys = both_ways(APP, job)
    assert_same(ours, celerys)


@settings(max_examples=1500, deadline=None)
@given(
    value=st.one_of(st.lists(json_values, max_size=8), st.dictionaries(texts, json_values, max_size=8)),
    maxsize=st.integers(1, 80),
    maxlevels=st.integers(0, 4),
)
def test_argsrepr_is_celerys_saferepr_at_every_limit(value: Any, maxsize: int, maxlevels: int) -> None:
    """Small limits, so that the cut falls anywhere: the rendering is used only when it fits."""
    assert celery_message._saferepr_of(value, maxsize, maxlevels) == saferepr(
        value, maxsize, maxlevels=maxlevels
    )


@pytest.mark.parametrize("length", range(1010, 1030))
@pytest.mark.parametrize("shape", ["text", "spaced", "number", "kwargs", "none"])
def test_argsrepr_at_the_length_celery_cuts(length: int, shape: str) -> None:
    args: list[Any]
    kwargs: dict[str, Any] = {}
    if shape == "text":
        args = ["a" * length]
    elif shape == "spaced":
        args = [("a " * length)[:length]]
    elif shape == "number":
        args = ["a" * (length - 20), 10**15]
    elif shape == "none":
        args = ["a" * (length - 10), None]
    else:
        args, kwargs = [], {"k": "é" * (length - 6)}
    job = dataclasses.replace(celery_message._probe_jobs(1024)[0], args=args, kwargs=kwargs)
    assert_same(*both_ways(APP, job))


def test_the_probe_finds_this_celery_agrees() -> None:
    assert celery_message.probe(celery_message.new_app()) is None


def test_the_probe_follows_the_apps_repr_limits() -> None:
    app = celery_message.new_app()
    app.conf.task_repr_maxlevels = 1
    app.amqp.argsrepr_maxsize = 40
    assert celery_message.probe(app) is None
    job = dataclasses.replace(celery_message._probe_jobs(1024)[0], args=[[1], "x" * 30], kwargs={"a": [2]})
    ours, celerys = both_ways(app, job)
    assert ours.headers["argsrepr"] == "[[...], 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx']"
    assert ours.headers["kwargsrepr"] == "{'a': [...]}"
    assert_same(ours, celerys)


def adapter() -> celery_backend.CeleryAdapter:
    options = {"broker_url": "redis://127.0.0.1:1/0", "allowed_jobs": ["app.**"]}
    return celery_backend.CeleryAdapter.from_options("t", options, publish_timeout_s=5)


def row() -> models.StagedJob:
    return dataclasses.replace(celery_message._probe_jobs(1024)[0], job_name="app.tasks.send")


def test_a_celery_that_builds_another_message_keeps_its_own_builder(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    drain_adapter = adapter()
    amqp = drain_adapter._app.amqp
    original = amqp.as_task_v2

    def as_task_v2(*args: Any, **kwargs: Any) -> Any:
        message = original(*args, **kwargs)
        message.headers["x-new-in-celery"] = 1
        return message

    monkeypatch.setattr(amqp, "as_task_v2", as_task_v2)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            built, rejected = backend.build_each([row()], drain_adapter._build(NOW), "celery")
            assert not rejected
            message, _envelope = built[0][1]
            assert message.headers["x-new-in-celery"] == 1  # Celery's builder made it
    warnings = [
        record for record in caplog.records if getattr(record, "event", "") == "celery_builder_differs"
    ]
    assert len(warnings) == 1, "logged once"
    assert "x-new-in-celery" in warnings[0].getMessage()


def test_a_kombu_serializing_otherwise_keeps_celerys_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    def dumps(data: Any, serializer: str) -> tuple[str, str, bytes]:
        return "application/json", "utf-8", b" " + celery_message._encode(data).encode()

    monkeypatch.setattr(celery_message, "_dumps", dumps)
    found = celery_message.probe(celery_message.new_app())
    assert found is not None
    assert found.startswith("probe row 1: body")


def test_the_same_celery_uses_the_drains_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    drain_adapter = adapter()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("as_task_v2 called for a row the drain builds")

    assert drain_adapter._fast_builder()
    monkeypatch.setattr(drain_adapter._app.amqp, "as_task_v2", refuse)
    built, rejected = backend.build_each([row()], drain_adapter._build(NOW), "celery")
    assert built and not rejected


def test_a_row_celery_refuses_is_refused_the_same_way() -> None:
    job = dataclasses.replace(row(), options={"priority": 256})
    ours, celerys = both_ways(APP, job)
    assert ours == celerys == (errors.JobRefused, "Celery option priority must be an integer 0-255, not 256")


@pytest.mark.parametrize("reply_to", ["", "a-thread-oid"])
def test_reply_to_as_celery_writes_it(reply_to: str) -> None:
    protocol = celery_message.Protocol2.of(APP)
    ours = celery_message.build(APP, row(), reply_to=reply_to, now=NOW, protocol=protocol)
    assert_same(ours, celery_message.build(APP, row(), reply_to=reply_to, now=NOW))
