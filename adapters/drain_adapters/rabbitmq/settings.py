"""The RabbitMQ backend's settings (``[backends.<name>]`` with ``type = "rabbitmq"``) and the one
function that turns a pika error into text safe to log: no URL, no password."""

from __future__ import annotations

import contextlib
import dataclasses
import urllib.parse
from collections.abc import Mapping
from typing import Any

import pika

from drain import errors
from drain.backend import options
from drain.observability.redaction import redact_url  # the one redaction
from drain_adapters.amqp import names as amqp_names

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_HEARTBEAT_S = 60
DEFAULT_MAX_MESSAGE_BYTES = 134_217_728  # RabbitMQ's max_message_size default (3.x)
EXCHANGE_TYPES = ("direct", "topic", "fanout", "headers")
ROUTING_KEYS = ("queue", "ordering_key")
"""What a message's routing key is: the row's queue (the default), or its ordering key when it
has one (for a consistent-hash exchange: every job of a key in one queue)."""
QUEUE_TYPES = ("classic", "quorum")
SHORT_STRING_BYTES = amqp_names.SHORT_STRING_BYTES  # exchange, routing key, type, header keys
PREDECLARED_EXCHANGES = {
    "amq.direct": "direct",
    "amq.fanout": "fanout",
    "amq.topic": "topic",
    "amq.headers": "headers",
    "amq.match": "headers",
}
"""The ``amq.`` exchanges every RabbitMQ declares itself, with their types: the only ``amq.``
exchanges ``declare = true`` can declare (again); any other ``amq.`` name is refused (403)."""


@dataclasses.dataclass(frozen=True)
class RabbitMQSettings:
    """``[backends.<name>]`` with ``type = "rabbitmq"``.

    ``urls``: the cluster's nodes (``url`` in the file: one URL, a list, or URLs separated by
    ``;``), tried in turn (``amqp_nodes``). ``queue_type``: the ``x-queue-type`` the declared
    queues get; None declares them without one (RabbitMQ's default, classic). ``routing_key``:
    ``"queue"``, or ``"ordering_key"`` to route a keyed job by its key (to a named exchange the
    operator declared and bound: ``declare = true`` binds queues by their names, which no key
    matches). ``queues``: with ``declare = true`` the queues declared (and bound); without,
    the queues ``drain check`` makes sure exist.
    """

    urls: tuple[str, ...] = (DEFAULT_URL,)
    exchange: str = ""
    exchange_type: str = "direct"
    declare: bool = False
    queues: tuple[str, ...] = ()
    queue_type: str | None = None
    publish_timeout_s: float = 10.0
    connect_timeout_s: float = 10.0
    heartbeat_s: int = DEFAULT_HEARTBEAT_S
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    routing_key: str = "queue"

    @property
    def by_key(self) -> bool:
        """Whether a keyed job's routing key is its ordering key."""
        return self.routing_key == "ordering_key"

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{field.name}={getattr(self, field.name)!r}" for field in dataclasses.fields(self)[1:]
        )
        return f"{type(self).__name__}(urls={[redact_url(url) for url in self.urls]!r}, {fields})"

    @classmethod
    def parse(cls, name: str, values: Mapping[str, Any], publish_timeout_s: float) -> RabbitMQSettings:
        """Read the section; raise ConfigError naming every bad key at once. No I/O."""
        values = dict(values)
        default_exchange = values.get("exchange") == ""
        if default_exchange:
            del values["exchange"]  # "" is the AMQP default exchange, not a missing value
        reader = options.OptionReader(values, f"backends.{name}.")
        timeout = reader.timeout("publish_timeout_s", publish_timeout_s, publish_timeout_s)
        urls = reader.string_or_strings("url") or (DEFAULT_URL,)
        settings = cls(
            urls=tuple(part.strip() for url in urls for part in url.split(";") if part.strip()),
            exchange=reader.string("exchange", "") or "",
            exchange_type=reader.string("exchange_type", "direct") or "direct",
            declare=reader.boolean("declare", False),
            queues=reader.strings("queues") or (),
            queue_type=reader.string("queue_type"),
            publish_timeout_s=float(timeout),
            connect_timeout_s=reader.timeout("connect_timeout_s", min(10.0, timeout), publish_timeout_s),
            heartbeat_s=reader.integer("heartbeat_s", DEFAULT_HEARTBEAT_S, minimum=0, maximum=3600),
            max_message_bytes=reader.integer("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES, minimum=1),
            routing_key=reader.string("routing_key", "queue") or "queue",
        )
        settings.check(reader)
        problems = reader.finish()
        if problems:
            raise errors.ConfigError(problems)
        return settings

    def check(self, reader: options.OptionReader) -> None:
        """Record in ``reader`` what is wrong with these values together."""
        if not self.urls or not all(url.startswith(("amqp://", "amqps://")) for url in self.urls):
            reader.problem("url", "must be an amqp:// or amqps:// URL, or a list of them (one per node)")
        for index, url in enumerate(self.urls):
            if not _parses(url):
                reader.problem(
                    "url",
                    f"node {index + 1} is no URL pika can read (a password's / ? # @ % must be "
                    "percent-encoded; query parameters must be pika's, with valid values)",
                )
        if self.queue_type is not None and self.queue_type not in QUEUE_TYPES:
            reader.problem("queue_type", f"must be one of {', '.join(QUEUE_TYPES)}")
        if self.queue_type is not None and not self.declare:
            reader.problem("queue_type", "is only used with declare = true")
        if self.exchange_type not in EXCHANGE_TYPES:
            reader.problem("exchange_type", f"must be one of {', '.join(EXCHANGE_TYPES)}")
        exchange_problem = amqp_names.short_string_problem(
            self.exchange, "the exchange"
        ) or amqp_names.line_break_problem(self.exchange, "the exchange")
        if exchange_problem:
            reader.problem("exchange", exchange_problem.replace("the exchange ", ""))
        elif self.declare and self.exchange.startswith(amqp_names.RESERVED_PREFIX):
            expected = PREDECLARED_EXCHANGES.get(self.exchange)
            if expected != self.exchange_type:
                known = ", ".join(f"{name} ({kind})" for name, kind in PREDECLARED_EXCHANGES.items())
                reader.problem(
                    "exchange",
                    "amq. exchanges are the broker's own: declare = true may only name one RabbitMQ "
                    f"predeclares, with its exchange_type: {known}",
                )
        for queue in self.queues:  # each is declared: RabbitMQ refuses empty and amq. names
            queue_problem = amqp_names.queue_name_problem(queue)
            if queue_problem:
                reader.problem("queues", queue_problem)
        self.check_routing_key(reader)

    def check_routing_key(self, reader: options.OptionReader) -> None:
        if self.routing_key not in ROUTING_KEYS:
            reader.problem(
                "routing_key", f"must be one of {', '.join(ROUTING_KEYS)}, not {self.routing_key!r}"
            )
        elif self.by_key and not self.exchange:
            reader.problem(
                "routing_key",
                '"ordering_key" needs a named exchange (on the default exchange the routing key '
                "is the name of a queue)",
            )
        elif self.by_key and self.declare:
            reader.problem(
                "routing_key",
                '"ordering_key" cannot be used with declare = true (declared queues are bound by '
                "their names, which no key matches): declare the exchange and its bindings yourself",
            )

    def describe(self, error: BaseException | str) -> str:
        """``error`` as one line of text with every URL and password masked."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {str(error) or repr(error)}"
        for url in self.urls:
            with contextlib.suppress(ValueError):
                secret = urllib.parse.urlsplit(url).password
                if secret:
                    text = text.replace(secret, "***")
            text = text.replace(url, redact_url(url))
        return text

    def node(self, index: int) -> str:
        """Node ``index`` as ``host:port``, safe to log (no user, no password)."""
        try:
            parts = urllib.parse.urlsplit(self.urls[index])
            default = 5671 if parts.scheme == "amqps" else 5672
            return f"{parts.hostname or 'localhost'}:{parts.port or default}"
        except ValueError:
            return f"node {index + 1}"


def _parses(url: str) -> bool:
    """Whether pika reads ``url``. Its error is never shown: it quotes the URL's parts, and a raw
    ``/`` in a password makes the password one of them (read as the port)."""
    try:
        pika.URLParameters(url)
    except Exception:  # noqa: BLE001 - whatever pika raises: the URL is unusable
        return False
    return True
