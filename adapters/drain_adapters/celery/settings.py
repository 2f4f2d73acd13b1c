"""Celery's section (``[backends.<name>]`` with ``type = "celery"``): the broker URL the drain can
publish to with acknowledgements, and Celery's own settings for the queues ``send_task`` declares."""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Mapping
from typing import Any

from drain import errors
from drain.backend import allowlist, options
from drain.observability import redaction  # the one redaction
from drain_adapters.redis import client as redis_client
from drain_adapters.redis import settings as redis_settings

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672//"
DEFAULT_MAX_MESSAGE_BYTES = 134_217_728  # RabbitMQ's max_message_size default
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")
QUEUE_TYPES = ("classic", "quorum")
QUEUE_TYPE_SETTINGS = ("task_create_missing_queue_type", "task_default_queue_type")
"""Celery's settings for the queues send_task declares, honoured on RabbitMQ (ignored on Redis, as
Celery ignores them there); with ``task_create_missing_queues`` (a boolean, default true: declare
a queue before publishing to it)."""
REDIS_SCHEMES = ("redis", "rediss")


def _url_problem(url: str) -> str | None:
    """Why ``url`` is no broker URL the drain can publish to with acknowledgements (never
    repeating the URL: it may hold a password), or None. ``;`` separates a cluster's nodes;
    Sentinel URLs: ``redis_settings``."""
    if redis_settings.is_sentinel_url(url):
        return None
    if ";" in url:
        nodes = [node.strip() for node in url.split(";") if node.strip()]
        if not nodes:
            return "is not a valid URL (no node between the ';')"
        if not all(node.split("://", 1)[0].lower() in AMQP_SCHEMES for node in nodes):
            return "a ';'-separated list of nodes is supported for RabbitMQ (amqp://) and Sentinel URLs only"
        return next((problem for node in nodes if (problem := _url_problem(node))), None)
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
    except ValueError as exc:
        return f"is not a valid URL ({str(exc).split(':', 1)[0]})"
    if parts.scheme not in AMQP_SCHEMES + REDIS_SCHEMES:
        return (
            f"transport {parts.scheme or '(none)'!r} is not supported: the drain publishes only where "
            "the broker acknowledges each write (amqp://, amqps://, pyamqp://, redis://, rediss://, "
            "sentinel://)"
        )
    database = parts.path.lstrip("/")
    if parts.scheme in REDIS_SCHEMES and database and not (database.isascii() and database.isdigit()):
        return "the Redis database (the URL's path) must be a number"
    return None


def _read_queue_settings(reader: options.OptionReader, values: Mapping[str, Any]) -> dict[str, Any]:
    """The QUEUE_TYPE_SETTINGS and ``task_create_missing_queues`` given, as Celery's conf keys."""
    found: dict[str, Any] = {}
    if "task_create_missing_queues" in values:
        found["task_create_missing_queues"] = reader.boolean("task_create_missing_queues", True)
    for key in QUEUE_TYPE_SETTINGS:
        value = reader.string(key)
        if value is None:
            continue
        if value not in QUEUE_TYPES:
            reader.problem(key, f"must be one of {', '.join(QUEUE_TYPES)}")
        found[key] = value
    return found


@dataclasses.dataclass(frozen=True)
class CelerySettings:
    """``[backends.<name>]`` with ``type = "celery"``."""

    broker_url: str = DEFAULT_URL
    allowed_jobs: allowlist.Allowlist | None = None
    publish_timeout_s: float = 10.0
    connect_timeout_s: float = 10.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    redis_target: str | redis_client.SentinelTarget | None = dataclasses.field(default=None, repr=False)
    """Where the Redis transport writes (None for AMQP): the URL, or Sentinel's master."""
    wait: redis_settings.Wait = dataclasses.field(default_factory=redis_settings.Wait)
    queue_settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Celery's own settings for the queues ``send_task`` declares (RabbitMQ): QUEUE_SETTINGS."""

    def __repr__(self) -> str:
        return redaction.redacted_repr(self, "broker_url")

    @property
    def transport(self) -> str:
        """``amqp`` or ``redis``."""
        if redis_settings.is_sentinel_url(self.broker_url):
            return "redis"
        return "redis" if urllib.parse.urlsplit(self.broker_url).scheme in REDIS_SCHEMES else "amqp"

    @classmethod
    def parse(cls, name: str, values: Mapping[str, Any], publish_timeout_s: float) -> CelerySettings:
        reader = options.OptionReader(values, f"backends.{name}.")
        timeout = reader.timeout("publish_timeout_s", publish_timeout_s, publish_timeout_s)
        patterns = reader.strings("allowed_jobs")
        confirm = reader.boolean("confirm_publish", True)
        settings = cls(
            broker_url=reader.string("broker_url", DEFAULT_URL) or DEFAULT_URL,
            publish_timeout_s=timeout,
            connect_timeout_s=reader.timeout("connect_timeout_s", min(10.0, timeout), publish_timeout_s),
            max_message_bytes=reader.integer("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES, minimum=1),
        )
        if patterns is not None:
            allowed, problems = allowlist.Allowlist.parse(patterns)
            for problem in problems:
                reader.problem("allowed_jobs", problem)
            settings = dataclasses.replace(settings, allowed_jobs=allowed)
        if not confirm:
            reader.problem(
                "confirm_publish",
                "must be true: publishing without confirmation could lose jobs silently",
            )
        url_problem = _url_problem(settings.broker_url)
        if url_problem:
            reader.problem("broker_url", url_problem)
        elif settings.transport == "redis":
            settings = dataclasses.replace(
                settings,
                redis_target=redis_settings.read_celery_target(reader, settings.broker_url),
                wait=redis_settings.read_wait(reader, timeout, "publish_timeout_s"),
            )
        settings = dataclasses.replace(settings, queue_settings=_read_queue_settings(reader, values))
        problems = reader.finish()
        if problems:
            raise errors.ConfigError(problems)
        return settings
