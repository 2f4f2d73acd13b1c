"""The Celery backend: each staged job becomes the task message ``send_task`` would send.

A row becomes ``app.send_task(job_name, args, kwargs, task_id=job_id, queue=queue, ...)``'s
message, built by Celery's own builder (``celery_message``: protocol 2, JSON), so an unmodified
``celery worker`` consuming that queue runs it and cannot tell it from ``send_task``'s. It is
published without ``send_task``'s one-confirm-at-a-time wait:

- RabbitMQ (``amqp://``, ``amqps://``, ``pyamqp://``): batches with many publisher confirms
  outstanding, mandatory, persistent (``celery_amqp``); each queue declared first as ``send_task``
  declares it (``celery_queues``, with the section's ``task_create_missing_queues``,
  ``task_create_missing_queue_type`` and ``task_default_queue_type``); a job whose queue is
  missing all the same is REJECTED.
- Redis (``redis://``, ``rediss://``, and kombu's ``sentinel://...;sentinel://...`` with
  ``broker_transport_options = {master_name = ...}``): one MULTI/EXEC pipeline per batch, laid
  out as kombu's Redis transport lays it out (``celery_redis``); the reply is the
  acknowledgement (with ``wait_replicas``, once that many replicas have the batch).

Any other transport would publish without an acknowledgement, and so does ``confirm_publish =
false``: both are refused by the settings (``drain check`` and ``drain run`` say why in one line).
``allowed_jobs`` limits the task names a row may name (``**`` is allowed: Celery looks a name up
in its task registry, it never walks attribute chains); without it ``drain check`` and ``drain
run`` warn once.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from drain import backend, errors, models
from drain.backend import allowlist, options
from drain.config import settings as config
from drain_adapters.celery import amqp_publisher as celery_amqp
from drain_adapters.celery import message as celery_message
from drain_adapters.celery import queues as celery_queues
from drain_adapters.celery import redis_publisher as celery_redis
from drain_adapters.redis import client as redis_client
from drain_adapters.redis import settings as redis_settings

log = logging.getLogger(__name__)

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
        return config.redacted_repr(self, "broker_url")

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


class CeleryAdapter:
    """Forward staged jobs as Celery tasks; see the module docstring."""

    def __init__(self, name: str, settings: CelerySettings) -> None:
        self.name = name
        self.settings = settings
        self._app = celery_message.new_app()
        self._amqp: celery_amqp.AmqpPublisher | None = None
        self._redis: celery_redis.RedisPublisher | None = None
        if settings.transport == "redis":
            self._redis = celery_redis.RedisPublisher(
                name, settings.redis_target or settings.broker_url, settings.publish_timeout_s, settings.wait
            )
        else:
            for key, value in settings.queue_settings.items():
                setattr(self._app.conf, key, value)
            app = self._app
            self._amqp = celery_amqp.AmqpPublisher(
                name,
                celery_amqp.AmqpAddress.parse_all(settings.broker_url),
                publish_timeout_s=settings.publish_timeout_s,
                connect_timeout_s=settings.connect_timeout_s,
                declarations=lambda queue: celery_queues.of(app, queue),
            )
        if settings.allowed_jobs is None:
            log.warning(
                "backend %s: no allowed_jobs; any row can make the Celery workers run any registered "
                'task (set allowed_jobs = ["app.tasks.*"])',
                name,
                extra={"event": "no_allowed_jobs", "backend": name},
            )

    def __repr__(self) -> str:
        return f"CeleryAdapter({self.name!r}, {self.settings!r})"

    @classmethod
    def from_options(
        cls, name: str, options_: Mapping[str, Any], *, publish_timeout_s: float
    ) -> CeleryAdapter:
        return cls(name, CelerySettings.parse(name, options_, publish_timeout_s))

    def open(self) -> None:
        if self._amqp is not None:
            self._amqp.open()
        else:
            assert self._redis is not None
            self._redis.open()

    def ping(self) -> None:
        if self._amqp is not None:
            self._amqp.ping()
        else:
            assert self._redis is not None
            self._redis.ping()

    def close(self) -> None:
        if self._amqp is not None:
            self._amqp.close()
        if self._redis is not None:
            self._redis.close()

    def _build(self, now: datetime.datetime) -> Callable[[models.StagedJob], Any]:
        """The function turning one row into what this broker is sent (``build_each``'s)."""
        app = self._app
        reply_to = app.thread_oid  # what send_task puts in reply_to
        allowed = self.settings.allowed_jobs
        max_bytes = self.settings.max_message_bytes
        to_wire = celery_amqp.wire if self._amqp is not None else celery_redis.wire

        def build(job: models.StagedJob) -> Any:
            if allowed is not None and not allowed.admits(job.job_name):
                raise errors.JobRefused(f"task {job.job_name!r} is not in allowed_jobs")
            message = celery_message.build(app, job, reply_to=reply_to, now=now)
            if len(message.body) > max_bytes:
                raise errors.JobRefused(f"message of {len(message.body)} bytes exceeds max_message_bytes")
            return to_wire(message)

        return build

    def submit(self, jobs: Sequence[models.StagedJob], /) -> Any:
        """Hand the batch to the broker; ``collect`` returns its results (PipelinedAdapter)."""
        built, rejected = backend.build_each(jobs, self._build(datetime.datetime.now(datetime.UTC)), "celery")
        wires = [wire for _job, wire in built]
        if self._amqp is not None:
            return self._amqp.submit(wires, celery_amqp.Ticket(results=rejected))
        assert self._redis is not None
        # A Redis pipeline reply comes back within one round trip: publish now, hand back the results.
        return [*rejected, *self._redis.publish(wires)]

    def collect(self, ticket: Any, /) -> list[models.PublishResult]:
        if isinstance(ticket, celery_amqp.Ticket):
            assert self._amqp is not None
            return self._amqp.collect(ticket)
        results: list[models.PublishResult] = ticket
        return results

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        return self.collect(self.submit(jobs))
