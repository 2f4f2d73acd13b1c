"""What the Dramatiq backend refuses, before any broker sees it: the section (one problem per bad
key, all at once) and the rows (each refusal is that row's rejection, with the reason). No I/O."""

from __future__ import annotations

import dataclasses
from typing import Any

import dramatiq
import hypothesis
import pytest
from drain_adapters import dramatiq as dramatiq_backend
from drain_adapters.dramatiq import message as dramatiq_message
from hypothesis import strategies as st

from drain import backend, errors, models
from tests.support import jobs

ACTOR = "app.send"
ALLOWED = frozenset({ACTOR, "app.done"})


def parse(**values: Any) -> dramatiq_backend.DramatiqSettings:
    return dramatiq_backend.DramatiqSettings.parse("d", values, 10.0)


def test_the_url_chooses_the_broker_and_a_cluster_is_a_list_of_nodes() -> None:
    nodes = ["amqp://app:s3cret@rabbit-1:5672/%2F", "amqp://app:s3cret@rabbit-2:5672/%2F"]
    amqp = parse(url=nodes, max_priority=10)
    assert amqp.amqp is not None and amqp.amqp.urls == tuple(nodes) and amqp.redis is None
    assert amqp.max_priority == 10
    redis = parse(url="redis://:s3cret@redis:6379/2", namespace="jobs", wait_replicas=1)
    assert redis.redis == "redis://:s3cret@redis:6379/2" and redis.amqp is None
    assert redis.namespace == "jobs" and redis.wait.replicas == 1
    sentinel = parse(sentinels=["10.0.0.1:26379"], master_name="mymaster")
    assert sentinel.redis is not None and not isinstance(sentinel.redis, str)
    assert "s3cret" not in repr(amqp) + repr(redis) + repr(sentinel)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"url": "amqp://h/%2F", "namespace": "x"}, "namespace"),  # Redis's key on RabbitMQ
        ({"url": "redis://h:6379/0", "max_priority": 5}, "max_priority"),  # RabbitMQ's on Redis
        ({"url": "amqp://h/%2F", "max_priority": 256}, "max_priority"),
        ({"url": "amqp://h/%2F", "exchange": "jobs"}, "exchange"),
        ({"url": "amqp://h/%2F", "queue_type": "quorum"}, "queue_type"),
        ({"url": "kafka://h"}, "url"),
        ({"url": "redis://h:6379/0", "namespace": ""}, "namespace"),
        ({"url": "redis://h:6379/0", "allowed_actors": "app.send"}, "allowed_actors"),
        ({"url": "amqp://h/%2F", "allowed_actors": []}, "allowed_actors"),
    ],
)
def test_a_bad_section_is_refused_naming_the_key(values: dict[str, Any], key: str) -> None:
    with pytest.raises(errors.ConfigError) as refused:
        parse(**values)
    assert any(key in problem for problem in refused.value.problems), refused.value.problems


def build(job: models.StagedJob, *, redis: bool = True) -> dramatiq_message.DramatiqMessage:
    return dramatiq_message.build(job, now_ms=1, allowed=ALLOWED, max_bytes=10_000, redis=redis)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"job_name": "os.system"}, "not in allowed_actors"),
        ({"queue": ""}, "no Dramatiq queue name"),
        ({"queue": "9lives"}, "no Dramatiq queue name"),
        ({"queue": "emails\n"}, "no Dramatiq queue name"),
        ({"queue": "emails.DQ"}, "delay or dead-letter"),
        ({"queue": "emails.XQ"}, "delay or dead-letter"),
        ({"queue": "amq.direct"}, "reserved"),
        ({"queue": "q" * 253}, "252 bytes at most"),
        ({"queue": "__heartbeats__"}, "Dramatiq's own Redis keys"),
        ({"queue": "emails.msgs"}, "Dramatiq's own Redis keys"),
        ({"options": {"eta": 1}}, "Dramatiq's own"),
        ({"options": {"redis_message_id": "x"}}, "Dramatiq's own"),
        ({"options": {"on_success": "os.system"}}, "not in allowed_actors"),
        ({"options": {"on_failure": ["app.done"]}}, "must be an actor name"),
        ({"options": {"pipe_target": {"actor_name": "os.system"}}}, "allowed_actors cannot check"),
        ({"options": {"group_completion_callbacks": []}}, "allowed_actors cannot check"),
        ({"options": {"broker_priority": 256}}, "0-255"),
        ({"options": {"broker_priority": True}}, "0-255"),
        ({"args": ["x" * 20_000]}, "exceeds max_message_bytes"),
    ],
)
def test_a_row_dramatiq_or_its_workers_would_not_take_is_refused(
    changes: dict[str, Any], reason: str
) -> None:
    job = dataclasses.replace(jobs.staged(1, "emails", ACTOR), **changes)
    built, rejected = backend.build_each([job], build, "dramatiq")
    assert not built
    [result] = rejected
    assert result.outcome is models.Outcome.REJECTED
    assert reason in (result.error or ""), result.error


def test_callbacks_naming_allowed_actors_and_dramatiq_options_travel() -> None:
    options = {"on_success": "app.done", "max_retries": 3, "time_limit": 60_000, "broker_priority": 5}
    job = dataclasses.replace(jobs.staged(1, "emails", ACTOR), options=options)
    message = build(job, redis=False)
    assert message.priority == 5
    assert (
        b'"options":{"on_success":"app.done","max_retries":3,"time_limit":60000,"broker_priority":5}'
        in message.body
    )


anything = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),  # jsonb holds no NaN
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    job_name=st.text(max_size=20) | st.sampled_from(sorted(ALLOWED)),
    queue=st.text(max_size=20) | st.sampled_from(["default", "emails", "a.DQ"]),
    args=st.lists(anything, max_size=3),
    kwargs=st.dictionaries(st.text(max_size=6), anything, max_size=3),
    options=st.dictionaries(
        st.sampled_from([*dramatiq_message.RESERVED_OPTIONS, *dramatiq_message.CALLBACK_OPTIONS])
        | st.sampled_from([*dramatiq_message.MESSAGE_OPTIONS, "broker_priority", "max_retries"])
        | st.text(max_size=6),
        anything,
        max_size=3,
    ),
    redis=st.booleans(),
)
def test_any_row_is_a_message_a_worker_decodes_or_a_rejection_with_a_reason(
    job_name: str, queue: str, args: list[Any], kwargs: dict[str, Any], options: dict[str, Any], redis: bool
) -> None:
    job = dataclasses.replace(jobs.staged(1, queue, job_name), args=args, kwargs=kwargs, options=options)
    built, rejected = backend.build_each([job], lambda j: build(j, redis=redis), "dramatiq")
    if rejected:
        assert rejected[0].outcome is models.Outcome.REJECTED and rejected[0].error
        return
    [(_job, message)] = built
    assert message.body.isascii()
    decoded = dramatiq.Message.decode(message.body)  # what the worker does first
    assert decoded.message_id == str(job.job_id) and decoded.actor_name == job_name
    assert decoded.queue_name == queue and decoded.args == tuple(args)
