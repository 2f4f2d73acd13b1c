"""Sentinel and wait_replicas for the RQ and Celery backends: parsed, refused in one line naming the
key, and never showing a password (drain_adapters.redis.settings)."""

from __future__ import annotations

from typing import Any

import pytest
from drain_adapters import celery, rq
from drain_adapters.rabbitmq import settings as rabbitmq_settings
from drain_adapters.redis import client as redis_client

from drain import config, errors
from drain.observability import redaction

SECRET = "s3cr3t-pw"
SENTINELS = ["10.0.0.1:26379", "10.0.0.2", "[::1]:26380"]
R, C = "backends.default.", "backends.tasks."  # the key prefixes problems start with


def rq_settings(**values: Any) -> rq.RQSettings:
    return rq.RQSettings.parse(
        "default", {"allowed_jobs": ["app.tasks.send_email"], **values}, publish_timeout_s=10.0
    )


def celery_settings(**values: Any) -> celery.CelerySettings:
    return celery.CelerySettings.parse("tasks", values, publish_timeout_s=10.0)


def problem(parse: Any, **values: Any) -> str:
    with pytest.raises(errors.ConfigError) as caught:
        parse(**values)
    text = str(caught.value)
    assert "\n" not in text
    assert SECRET not in text
    return text


def test_rq_sentinels_name_the_master_and_its_login() -> None:
    settings = rq_settings(
        sentinels=SENTINELS,
        master_name="mymaster",
        db=2,
        password=SECRET,
        sentinel_password=SECRET,
        sentinel_ssl=True,
        wait_replicas=1,
    )
    target = settings.sentinel
    assert target is not None
    assert target.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380))
    assert (target.master_name, target.db, target.password, target.sentinel_ssl) == (
        "mymaster",
        2,
        SECRET,
        True,
    )
    assert settings.wait.replicas == 1
    assert settings.wait.timeout_s == 1.0
    assert SECRET not in repr(settings)


def test_rq_without_sentinels_keeps_its_url() -> None:
    settings = rq_settings(url="redis://h:6380/1")
    assert settings.sentinel is None
    assert settings.url == "redis://h:6380/1"
    assert rq_settings().url == rq.DEFAULT_URL


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"sentinels": SENTINELS}, R + "master_name: is required with sentinels"),
        (
            {"sentinels": SENTINELS, "master_name": "m", "url": "redis://h/0"},
            R + "url: cannot be combined with sentinels",
        ),
        ({"sentinels": ["h:0"], "master_name": "m"}, R + "sentinels: 'h:0' has no valid port"),
        ({"sentinels": ["h:x"], "master_name": "m"}, R + "sentinels: 'h:x' has no valid port"),
        (
            {"sentinels": ["u@h:1"], "master_name": "m"},
            R + "sentinels: 'u@h:1' is not host:port",
        ),
        (
            {"sentinels": [], "master_name": "m"},
            R + "sentinels: must name at least one sentinel",
        ),
        ({"password": SECRET}, R + "password: is only read with sentinels"),
        ({"master_name": "m"}, R + "master_name: is only read with sentinels"),
        ({"url": "http://h"}, R + "url: must be a redis://, rediss:// or unix:// URL"),
        ({"wait_replicas": -1}, R + "wait_replicas: must be at least 0"),
        ({"wait_timeout_s": 9}, R + "wait_timeout_s: must be below socket_timeout_s (5)"),
    ],
)
def test_rq_problems_are_one_line_naming_the_key(values: dict[str, Any], expected: str) -> None:
    assert expected in problem(rq_settings, **values)


URL = f"sentinel://:{SECRET}@10.0.0.1:26379/3;sentinel://10.0.0.2:26380;sentinel://:{SECRET}@10.0.0.3"


def test_celery_takes_kombus_sentinel_urls_and_transport_options() -> None:
    settings = celery_settings(
        broker_url=URL,
        broker_transport_options={
            "master_name": "mymaster",
            "sentinel_kwargs": {"password": SECRET},
            "visibility_timeout": 3600,  # the workers' business: ignored
        },
        wait_replicas=1,
    )
    assert settings.transport == "redis"
    target = settings.redis_target
    assert isinstance(target, redis_client.SentinelTarget)
    assert target.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("10.0.0.3", 26379))
    assert (target.master_name, target.db, target.password, target.sentinel_password) == (
        "mymaster",
        3,
        SECRET,
        SECRET,
    )
    assert settings.wait.replicas == 1
    assert SECRET not in repr(settings)
    adapter = celery.CeleryAdapter("tasks", settings)
    assert SECRET not in repr(adapter)


def test_celery_redis_url_keeps_working_with_or_without_transport_options() -> None:
    assert celery_settings(broker_url="redis://h:6379/0").redis_target == "redis://h:6379/0"
    options = {"broker_url": "redis://h/0", "broker_transport_options": {"visibility_timeout": 60}}
    assert celery_settings(**options).redis_target == "redis://h/0"


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (
            {"broker_url": URL},
            C + "broker_transport_options: master_name (a non-empty string) is required",
        ),
        (
            {
                "broker_url": URL,
                "broker_transport_options": {"master_name": "m", "sentinel_kwargs": {"db": 1}},
            },
            C + "broker_transport_options: sentinel_kwargs must be a table of username, password, ssl",
        ),
        (
            {"broker_url": "redis://h/0", "broker_transport_options": {"global_keyprefix": "app:"}},
            C + "broker_transport_options: global_keyprefix is not supported",
        ),
        (
            {
                "broker_url": "sentinel://h:1;redis://:" + SECRET + "@h2",
                "broker_transport_options": {"master_name": "m"},
            },
            C + "broker_url: mixes sentinel:// with other schemes",
        ),
        (
            {
                "broker_url": f"sentinel://:{SECRET}@[::1;sentinel://h",
                "broker_transport_options": {"master_name": "m"},
            },
            C + "broker_url: is not a valid URL",
        ),
        (
            {
                "broker_url": URL,
                "broker_transport_options": {"master_name": "m", "sentinel_kwargs": {"ssl": "no"}},
            },
            C + "broker_transport_options: sentinel_kwargs must be a table of username, password, ssl",
        ),
        (
            {"broker_url": "sentinel://h:99999", "broker_transport_options": {"master_name": "m"}},
            C + "broker_url: 'h:99999' has no valid port",
        ),
        (
            {"broker_url": "redis://h/0", "wait_replicas": 1, "wait_timeout_s": 10},
            C + "wait_timeout_s: must be below publish_timeout_s (10)",
        ),
        ({"broker_url": "amqp://h//", "wait_replicas": 1}, C + "wait_replicas: unknown key"),
    ],
)
def test_celery_problems_are_one_line_naming_the_key(values: dict[str, Any], expected: str) -> None:
    assert expected in problem(celery_settings, **values)


def test_every_password_of_a_multi_host_url_is_redacted() -> None:
    assert SECRET not in redaction.redact_url(URL)
    assert redaction.redact_url(URL).count("***") == 2
    assert SECRET not in redaction.redact(f"connecting to {URL} failed")


def test_show_config_masks_sentinel_passwords(tmp_path: Any) -> None:
    path = tmp_path / "drain.toml"
    path.write_text(
        '[backends.default]\ntype = "rq"\nallowed_jobs = ["app.tasks.send_email"]\nmaster_name = "m"\n'
        f'sentinels = ["h1:26379"]\npassword = "{SECRET}"\nsentinel_password = "{SECRET}"\n'
        f'[backends.tasks]\ntype = "celery"\nbroker_url = "{URL}"\n'
        f'broker_transport_options = {{ master_name = "m", sentinel_kwargs = {{ password = "{SECRET}" }} }}\n'
    )
    rows = config.describe(config.load(path, env={}))
    assert SECRET not in repr(rows)


@pytest.mark.parametrize(
    ("parse", "key"),
    [
        (lambda v: rq.RQSettings.parse("default", {"allowed_jobs": ["a.b"], **v}, 2.0), "socket_timeout_s"),
        (lambda v: celery.CelerySettings.parse("default", v, 2.0), "publish_timeout_s"),
        (lambda v: celery.CelerySettings.parse("default", v, 2.0), "connect_timeout_s"),
        (lambda v: rabbitmq_settings.RabbitMQSettings.parse("default", v, 2.0), "publish_timeout_s"),
        (lambda v: rabbitmq_settings.RabbitMQSettings.parse("default", v, 2.0), "connect_timeout_s"),
    ],
)
def test_a_backends_timeout_over_the_top_level_publish_timeout_is_refused(parse: Any, key: str) -> None:
    """The session's fences derive from the top-level publish_timeout_s (2 s: 12 s): a backend
    waiting 30 s inside a batch's transaction lost the session and published the batch twice
    (red team 25)."""
    text = problem(lambda **values: parse(values), **{key: 30})
    assert text.startswith(f"backends.default.{key}: must be at most the top-level publish_timeout_s (2)")
    parse({key: 2})  # at the top-level value: fine
