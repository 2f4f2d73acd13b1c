"""The Celery backend's settings and row options: what is refused, and that nothing a row carries
can do more than reject that row (no service needed, except the one CLI check on Postgres)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from drain_adapters import celery as celery_backend
from drain_adapters.celery import message as celery_message
from drain_adapters.celery import queues as celery_queues
from drain_adapters.celery import redis_publisher as celery_redis
from hypothesis import given, settings
from hypothesis import strategies as st

from drain import backend, errors, models
from tests.support import celery_rig, processes

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def job(**changes: Any) -> models.StagedJob:
    base = models.StagedJob(
        id=7,
        job_id=uuid.uuid4(),
        job_name="app.tasks.send",
        args=[1],
        kwargs={},
        queue="mail",
        backend="default",
        options={},
        created_at=NOW,
    )
    return dataclasses.replace(base, **changes)


def adapter(**options: Any) -> celery_backend.CeleryAdapter:
    values = {"broker_url": "amqp://127.0.0.1:1//", "allowed_jobs": ["app.**"], **options}
    return celery_backend.CeleryAdapter.from_options("t", values, publish_timeout_s=5)


def outcome(row: models.StagedJob, **options: Any) -> tuple[list[Any], list[models.PublishResult]]:
    built = adapter(**options)._build(NOW)
    return backend.build_each([row], built, "celery")


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"confirm_publish": False}, "confirm_publish: must be true"),
        ({"broker_url": "memory://"}, "transport 'memory' is not supported"),
        ({"broker_url": "sqs://k:s@"}, "transport 'sqs' is not supported"),
        ({"broker_url": "filesystem://"}, "transport 'filesystem' is not supported"),
        ({"allowed_jobs": ["app..x"]}, "empty segment"),
        ({"allowed_jobs": "app.*"}, "list of non-empty strings"),
        ({"publish_timeout_s": 0}, "at least 0.1"),
        ({"exchange": "x"}, "exchange: unknown key"),
        ({"broker_url": "amqp://u:pw@host:notaport//"}, "is not a valid URL"),
        ({"broker_url": "amqp://u:pw@host:99999//"}, "is not a valid URL"),
        ({"broker_url": "amqp://[::1//"}, "is not a valid URL"),
        ({"broker_url": "redis://:pw@host/zero"}, "must be a number"),
        ({"broker_url": "no scheme"}, "transport '(none)' is not supported"),
        ({"broker_url": "amqp://u:pw@h1//;redis://h2/0"}, "for RabbitMQ (amqp://) and Sentinel URLs only"),
        ({"broker_url": "amqp://u:pw@h1//;amqp://u:pw@h2:notaport//"}, "is not a valid URL"),
        ({"broker_url": " ; "}, "is not a valid URL"),
        ({"task_create_missing_queue_type": "stream"}, "must be one of classic, quorum"),
        ({"task_create_missing_queues": "yes"}, "must be true or false"),
    ],
)
def test_settings_refused_with_the_reason(values: dict[str, Any], problem: str) -> None:
    with pytest.raises(errors.ConfigError) as raised:
        celery_backend.CelerySettings.parse("t", values, 10)
    assert any(problem in line for line in raised.value.problems), raised.value.problems
    assert not any("pw" in line for line in raised.value.problems), "a password in an error"


@settings(max_examples=100, deadline=None)
@given(url=st.text(max_size=60) | st.from_regex(r"(amqp|redis|rediss|amqps)://[ -~]{0,40}", fullmatch=True))
def test_any_broker_url_is_a_config_error_or_an_adapter(url: str) -> None:
    try:
        built = celery_backend.CeleryAdapter.from_options(
            "t", {"broker_url": url, "allowed_jobs": ["a"]}, publish_timeout_s=1
        )
    except errors.ConfigError:
        return
    assert built.settings.broker_url == url


def test_double_star_is_allowed_and_the_password_stays_out_of_repr() -> None:
    parsed = celery_backend.CelerySettings.parse(
        "t", {"broker_url": "amqp://u:s3cret@h//", "allowed_jobs": ["app.**"]}, 10
    )
    assert parsed.allowed_jobs is not None and parsed.allowed_jobs.admits("app.a.b.c")
    assert "s3cret" not in repr(parsed) and "s3cret" not in repr(celery_backend.CeleryAdapter("t", parsed))


def test_the_queue_declared_is_the_one_send_task_declares_with_celerys_settings() -> None:
    """Celery's defaults: a durable queue named after the row's queue, bound to a durable direct
    exchange of that name; ``task_create_missing_queue_type`` and ``task_default_queue_type``
    (the ``celery`` queue) as Celery reads them; nothing without ``task_create_missing_queues``."""
    app = adapter()._app
    declared = celery_queues.of(app, "mail")
    assert declared == celery_queues.Declaration(
        queue="mail",
        durable=True,
        exclusive=False,
        auto_delete=False,
        arguments=None,
        exchange="mail",
        exchange_type="direct",
        exchange_durable=True,
        exchange_auto_delete=False,
        exchange_arguments=None,
        routing_key="mail",
        binding_arguments=None,
    )
    assert "mail" not in app.amqp.queues, "a row's queue name is not remembered by the app"
    quorum = adapter(task_create_missing_queue_type="quorum", task_default_queue_type="quorum")._app
    assert celery_queues.of(quorum, "mail").arguments == {"x-queue-type": "quorum"}  # type: ignore[union-attr]
    assert celery_queues.of(quorum, "celery").arguments == {"x-queue-type": "quorum"}  # type: ignore[union-attr]
    assert celery_queues.of(adapter(task_create_missing_queues=False)._app, "mail") is None
    for undeclarable in ("", "amq.mail", "q" * 256, "é" * 128):
        # the server would invent a name (a new queue per try), refuse the reserved prefix or the length
        assert celery_queues.of(app, undeclarable) is None, undeclarable
    assert celery_queues.of(app, "q" * 255) is not None


def test_missing_allowed_jobs_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    celery_backend.CeleryAdapter.from_options("t", {"broker_url": "redis://127.0.0.1/0"}, publish_timeout_s=5)
    warnings = [r for r in caplog.records if "allowed_jobs" in r.getMessage()]
    assert len(warnings) == 1


def test_drain_check_refuses_an_unconfirmed_configuration(database: str, tmp_path: Path) -> None:
    config = celery_rig.write_config(
        tmp_path / "drain.toml", database, "redis://127.0.0.1:6379/0", backend={"confirm_publish": False}
    )
    for command in ("check", "run"):
        done = processes.drain_cli(command, "--config", str(config), dsn=database, timeout_s=60)
        assert done.returncode != 0
        assert "confirm_publish: must be true" in done.stderr
        assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"job_name": "os.system"}, "not in allowed_jobs"),
        ({"job_name": "app..x"}, "not in allowed_jobs"),
        ({"options": {"countdown": 5}}, "unknown Celery option(s) countdown"),
        ({"options": {"priority": 256}}, "priority must be an integer 0-255"),
        ({"options": {"priority": True}}, "priority must be an integer 0-255"),
        ({"options": {"expires": "tomorrow"}}, "not an ISO 8601 date"),
        ({"options": {"expires": "2026-01-01T00:00:00"}}, "time zone"),
        ({"options": {"expires": -1}}, "must not be negative"),
        ({"options": {"time_limit": "10"}}, "time_limit must be a number"),
        ({"options": {"soft_time_limit": float("nan")}}, "soft_time_limit must be a number"),
        ({"options": {"headers": ["x"]}}, "headers must be an object"),
        ({"options": {"headers": {"id": "other"}}}, "Celery's own id"),
        ({"options": {"headers": {"task": "os.system"}}}, "Celery's own task"),
        ({"options": {"retries": -1}}, "retries must be an integer 0-"),
        ({"options": {"ignore_result": "yes"}}, "ignore_result must be true or false"),
        ({"options": {"shadow": ""}}, "shadow must be a non-empty string"),
        ({"queue": "q" * 256}, "longer than 255 bytes"),
        ({"options": {"headers": {"big": 2**70}}}, "does not fit 64 bits"),
        ({"options": {"headers": {"x" * 256: 1}}}, "longer than 255 bytes"),
        ({"options": {"headers": {"deep": [[[[{"n": -(2**64)}]]]]}}}, "does not fit 64 bits"),
        ({"options": {"expires": 1e12}}, "expires is too far ahead"),
        ({"options": {"expires": "9999-12-31T23:59:59-14:00"}}, "outside the dates Python holds in UTC"),
        ({"options": {"expires": "0001-01-01T00:00:00+14:00"}}, "outside the dates Python holds in UTC"),
        ({"options": {"expires": "NaN"}}, "not an ISO 8601 date"),
        ({"options": {"expires": "inf"}}, "not an ISO 8601 date"),
        ({"options": {"retries": 2**70}}, "retries must be an integer 0-"),
        ({"job_name": "app.tasks.\udc80"}, "the job name is not valid Unicode"),
        ({"queue": "mail\ud800"}, "the queue name is not valid Unicode"),
        ({"options": {"shadow": "\udfff"}}, "shadow is not valid Unicode"),
        ({"options": {"headers": {"a": {"\ud800": 1}}}}, "is not valid Unicode"),
        ({"options": {"headers": {"CC": "mail"}}}, "header CC must be an array"),
        ({"options": {"headers": {"BCC": ["amq.gen-1"]}}}, "is reserved"),
        ({"options": {"headers": {"CC": [""]}}}, "name is empty"),
        ({"queue": "amq.direct"}, "is reserved"),
        ({"queue": ""}, "queue name is empty"),
    ],
)
def test_a_row_celery_cannot_accept_is_that_rows_rejection(changes: dict[str, Any], reason: str) -> None:
    built, rejected = outcome(job(**changes))
    assert built == []
    assert [r.outcome for r in rejected] == [models.Outcome.REJECTED]
    assert reason in (rejected[0].error or ""), rejected[0].error


def test_a_message_over_max_message_bytes_is_rejected() -> None:
    _built, rejected = outcome(job(args=["x" * 2_000]), max_message_bytes=1_000)
    assert "exceeds max_message_bytes" in (rejected[0].error or "")


def test_options_map_to_celerys_own() -> None:
    row = job(
        options={
            "priority": 9,
            "expires": 60,
            "time_limit": 30,
            "soft_time_limit": 20,
            "headers": {"tenant": "a"},
            "retries": 3,
            "ignore_result": True,
            "shadow": "send",
        }
    )
    message = celery_message.build(celery_message.new_app(), row, reply_to="r", now=NOW)
    assert message.headers["id"] == message.headers["root_id"] == str(row.job_id)
    assert message.headers["task"] == "app.tasks.send"
    assert message.headers["timelimit"] == [30.0, 20.0]
    assert message.headers["expires"] == "2026-01-01T00:01:00+00:00"
    assert (message.headers["retries"], message.headers["shadow"]) == (3, "send")
    assert message.headers["ignore_result"] is True and message.headers["tenant"] == "a"
    assert message.properties == {
        "correlation_id": str(row.job_id),
        "reply_to": "r",
        "delivery_mode": 2,
        "expiration": "60000",
        "priority": 9,
    }
    assert json.loads(message.body) == [
        [1],
        {},
        {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
    ]
    assert celery_redis.list_key("mail", 9) == "mail\x06\x169"
    assert celery_redis.list_key("mail", 2) == "mail"
    assert celery_redis.list_key("mail", 200) == "mail\x06\x169"


def test_an_expiry_in_the_past_is_sent_expired_like_send_task_does() -> None:
    row = job(options={"expires": "2025-01-01T00:00:00+00:00"})
    message = celery_message.build(celery_message.new_app(), row, reply_to="r", now=NOW)
    assert message.properties["expiration"] == "0"


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)  # lone surrogates too
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3),
    max_leaves=8,
)
EXPIRES = st.one_of(
    st.floats(),
    st.integers(),
    st.datetimes(timezones=st.timezones()).map(datetime.datetime.isoformat),
    st.sampled_from(["NaN", "inf", "-inf", "9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00"]),
)
NAMES = st.one_of(
    st.text(max_size=40), ANY_TEXT, st.sampled_from(["", "amq.gen-x", "amq.rabbitmq.reply-to", "é" * 128])
)


@settings(max_examples=200, deadline=None)
@given(
    name=st.one_of(st.text(max_size=40), ANY_TEXT),
    queue=NAMES,
    options=st.dictionaries(
        st.sampled_from([*celery_message.KNOWN_OPTIONS, "eta", "countdown", ""]),
        JSON | st.floats() | EXPIRES | st.integers(min_value=2**62),
        max_size=4,
    ),
    copies=st.one_of(st.none(), st.lists(NAMES, max_size=2), JSON),
    args=st.lists(JSON, max_size=3),
)
def test_no_row_can_do_more_than_reject_itself(
    name: str, queue: str, options: Any, copies: Any, args: Any
) -> None:
    if copies is not None and isinstance(options.get("headers"), dict):
        options["headers"]["CC"] = copies
    row = job(job_name=name, queue=queue, options=options, args=args)
    built, rejected = outcome(row, allowed_jobs=["**"])
    assert len(built) + len(rejected) == 1
    for result in rejected:  # validation names the reason; the catch-all net is never needed
        assert not re.match(r"celery: \w+(Error|Exception): ", result.error or ""), result.error
    for _job, (message, wire) in built:
        envelope = json.loads(celery_redis.envelope(message))
        assert envelope["headers"]["id"] == str(row.job_id)
        assert envelope["headers"]["task"] == name
        # what RabbitMQ takes without closing the channel or the connection
        assert celery_queues.declarable(queue) and wire.header_frame_bytes > 0
        expiration = message.properties.get("expiration")
        assert expiration is None or (
            expiration.isascii() and expiration.isdigit() and int(expiration) <= 2**32 - 1
        )
        assert json.dumps(message.headers, ensure_ascii=False).encode()  # no lone surrogate
