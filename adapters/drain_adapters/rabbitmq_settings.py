"""The RabbitMQ backend's settings (``[backends.<name>]`` with ``type = "rabbitmq"``) and the one
function that turns a pika error into text safe to log: no URL, no password."""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Mapping
from typing import Any

from drain import config, errors, options

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_HEARTBEAT_S = 60
DEFAULT_MAX_MESSAGE_BYTES = 134_217_728  # RabbitMQ's max_message_size default (3.x)
EXCHANGE_TYPES = ("direct", "topic", "fanout", "headers")
SHORT_STRING_BYTES = 255  # AMQP 0-9-1 short strings (exchange, routing key, type, header keys)


@dataclasses.dataclass(frozen=True)
class RabbitMQSettings:
    """``[backends.<name>]`` with ``type = "rabbitmq"``."""

    url: str = DEFAULT_URL
    exchange: str = ""
    exchange_type: str = "direct"
    declare: bool = False
    queues: tuple[str, ...] = ()
    publish_timeout_s: float = 10.0
    connect_timeout_s: float = 10.0
    heartbeat_s: int = DEFAULT_HEARTBEAT_S
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __repr__(self) -> str:
        return config.redacted_repr(self, "url")

    @classmethod
    def parse(cls, name: str, values: Mapping[str, Any], publish_timeout_s: float) -> RabbitMQSettings:
        """Read the section; raise ConfigError naming every bad key at once. No I/O."""
        values = dict(values)
        default_exchange = values.get("exchange") == ""
        if default_exchange:
            del values["exchange"]  # "" is the AMQP default exchange, not a missing value
        reader = options.OptionReader(values, f"backends.{name}.")
        timeout = reader.number("publish_timeout_s", publish_timeout_s, minimum=0.1)
        settings = cls(
            url=reader.string("url", DEFAULT_URL) or DEFAULT_URL,
            exchange=reader.string("exchange", "") or "",
            exchange_type=reader.string("exchange_type", "direct") or "direct",
            declare=reader.boolean("declare", False),
            queues=reader.strings("queues") or (),
            publish_timeout_s=float(timeout),
            connect_timeout_s=reader.number("connect_timeout_s", min(10.0, timeout), minimum=0.1),
            heartbeat_s=reader.integer("heartbeat_s", DEFAULT_HEARTBEAT_S, minimum=0, maximum=3600),
            max_message_bytes=reader.integer("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES, minimum=1),
        )
        if not settings.url.startswith(("amqp://", "amqps://")):
            reader.problem("url", "must be an amqp:// or amqps:// URL")
        if settings.exchange_type not in EXCHANGE_TYPES:
            reader.problem("exchange_type", f"must be one of {', '.join(EXCHANGE_TYPES)}")
        if len(settings.exchange.encode()) > SHORT_STRING_BYTES:
            reader.problem("exchange", f"must be at most {SHORT_STRING_BYTES} bytes in UTF-8")
        if any(len(queue.encode()) > SHORT_STRING_BYTES for queue in settings.queues):
            reader.problem("queues", f"each must be at most {SHORT_STRING_BYTES} bytes in UTF-8")
        if settings.queues and not settings.declare:
            reader.problem("queues", "is only used with declare = true")
        problems = reader.finish()
        if problems:
            raise errors.ConfigError(problems)
        return settings

    def describe(self, error: BaseException | str) -> str:
        """``error`` as one line of text with the URL and its password masked."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {str(error) or repr(error)}"
        secret = urllib.parse.urlsplit(self.url).password
        if secret:
            text = text.replace(secret, "***")
        return text.replace(self.url, config.redact_url(self.url))
