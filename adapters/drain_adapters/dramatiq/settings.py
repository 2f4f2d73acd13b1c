"""Dramatiq's section (``[backends.<name>]`` with ``type = "dramatiq"``).

Which broker: ``url`` is an ``amqp://`` (or ``amqps://``) URL, or a list of them (a RabbitMQ
cluster's nodes, tried in turn), or a ``redis://`` URL; ``sentinels`` with ``master_name``
instead of a URL reach Redis through Sentinel (the RQ backend's keys, ``redis_settings``).

What must match the workers' broker, as they construct it:

- RabbitMQ: ``max_priority`` (``RabbitmqBroker(max_priority=...)``) and ``dead_message_ttl_ms``
  (Dramatiq's ``dramatiq_dead_message_ttl`` environment variable), the arguments the queues are
  declared with. A queue that exists with other arguments is used as it is, never redeclared.
- Redis: ``namespace`` (``RedisBroker(namespace=...)``), the prefix of every key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from drain import errors
from drain.backend import options
from drain.observability import redaction  # the one redaction
from drain_adapters.rabbitmq import settings as rabbitmq_settings
from drain_adapters.redis import client as redis_client
from drain_adapters.redis import settings as redis_settings

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_NAMESPACE = "dramatiq"  # RedisBroker's default
DEFAULT_DEAD_MESSAGE_TTL_MS = 86_400_000 * 7  # Dramatiq's, for the dead-letter queues
DEFAULT_MAX_MESSAGE_BYTES = 134_217_728  # RabbitMQ's max_message_size default
MAX_REDIS_MESSAGE_BYTES = 536_870_912  # Redis's proto-max-bulk-len default
AMQP_SCHEMES = ("amqp://", "amqps://")


@dataclasses.dataclass(frozen=True)
class DramatiqSettings:
    """``[backends.<name>]`` with ``type = "dramatiq"``; ``amqp`` or ``redis`` is set, never both."""

    allowed_actors: frozenset[str] | None = None
    publish_timeout_s: float = 10.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    amqp: rabbitmq_settings.RabbitMQSettings | None = None
    """The AMQP connection's settings (nodes, timeouts, heartbeat): RabbitMQ's link is reused."""
    max_priority: int | None = None
    dead_message_ttl_ms: int = DEFAULT_DEAD_MESSAGE_TTL_MS
    redis: str | redis_client.SentinelTarget | None = dataclasses.field(default=None, repr=False)
    """Where Redis is: the URL, or Sentinel's master."""
    namespace: str = DEFAULT_NAMESPACE
    wait: redis_settings.Wait = dataclasses.field(default_factory=redis_settings.Wait)

    def __repr__(self) -> str:
        where = repr(self.amqp) if self.amqp is not None else self._redis_shown()
        return (
            f"DramatiqSettings({where}, allowed_actors={self.allowed_actors!r}, "
            f"namespace={self.namespace!r}, max_priority={self.max_priority!r})"
        )

    def _redis_shown(self) -> str:
        if isinstance(self.redis, str):
            return redaction.redact_url(self.redis)
        return repr(self.redis)

    @classmethod
    def parse(cls, name: str, values: Mapping[str, Any], publish_timeout_s: float) -> DramatiqSettings:
        """Read the section; raise ConfigError naming every bad key at once. No I/O."""
        url = values.get("url", DEFAULT_URL if values.get("sentinels") is None else None)
        if _is_amqp(url):
            return cls._parse_amqp(name, values, publish_timeout_s)
        return cls._parse_redis(name, values, publish_timeout_s)

    @classmethod
    def _parse_amqp(cls, name: str, values: Mapping[str, Any], publish_timeout_s: float) -> DramatiqSettings:
        own = ("allowed_actors", "max_priority", "dead_message_ttl_ms")
        reader = options.OptionReader({key: values[key] for key in own if key in values}, f"backends.{name}.")
        link_values = {key: value for key, value in values.items() if key not in own}
        problems: list[str] = []
        amqp = None
        try:
            amqp = rabbitmq_settings.RabbitMQSettings.parse(name, link_values, publish_timeout_s)
        except errors.ConfigError as exc:
            problems.extend(exc.problems)
        priority = reader.integer("max_priority", 0, minimum=0, maximum=255)
        settings = cls(
            allowed_actors=_allowed(reader),
            publish_timeout_s=amqp.publish_timeout_s if amqp else publish_timeout_s,
            max_message_bytes=amqp.max_message_bytes if amqp else DEFAULT_MAX_MESSAGE_BYTES,
            amqp=amqp,
            max_priority=priority or None,
            dead_message_ttl_ms=reader.integer(
                "dead_message_ttl_ms", DEFAULT_DEAD_MESSAGE_TTL_MS, minimum=0, maximum=2**32 - 1
            ),
        )
        topology = ("exchange", "exchange_type", "declare", "queues", "queue_type", "routing_key")
        for key in topology if amqp is not None else ():
            if key in values:
                problems.append(
                    f"backends.{name}.{key}: not Dramatiq's: its messages go to the default exchange, "
                    "to the row's queue, declared as Dramatiq declares it"
                )
        problems.extend(reader.finish())
        if problems:
            raise errors.ConfigError(problems)
        return settings

    @classmethod
    def _parse_redis(cls, name: str, values: Mapping[str, Any], publish_timeout_s: float) -> DramatiqSettings:
        reader = options.OptionReader(values, f"backends.{name}.")
        timeout = reader.timeout("publish_timeout_s", publish_timeout_s, publish_timeout_s)
        target = redis_settings.read_rq_target(reader, values, DEFAULT_URL)
        namespace = reader.string("namespace", DEFAULT_NAMESPACE) or ""
        if not namespace:
            reader.problem("namespace", "must not be empty")
        settings = cls(
            allowed_actors=_allowed(reader),
            publish_timeout_s=timeout,
            max_message_bytes=reader.integer(
                "max_message_bytes", MAX_REDIS_MESSAGE_BYTES, minimum=1, maximum=MAX_REDIS_MESSAGE_BYTES
            ),
            redis=target,
            namespace=namespace,
            wait=redis_settings.read_wait(reader, timeout, "publish_timeout_s"),
        )
        problems = reader.finish()
        if problems:
            raise errors.ConfigError(
                [p.replace("must be a redis://", "must be an amqp://, amqps://, redis://") for p in problems]
            )
        return settings


def _is_amqp(url: Any) -> bool:
    urls = url if isinstance(url, (list, tuple)) else [url]
    return bool(urls) and all(isinstance(each, str) and each.startswith(AMQP_SCHEMES) for each in urls)


def _allowed(reader: options.OptionReader) -> frozenset[str] | None:
    """``allowed_actors``: actor names, matched exactly (Dramatiq looks a name up in its registry)."""
    names = reader.strings("allowed_actors")
    if names is None:
        return None
    if not names:
        reader.problem("allowed_actors", "must name at least one actor (leave it out to allow every actor)")
    return frozenset(names)
