"""Celery messages onto RabbitMQ with many publisher confirms outstanding (py-amqp, kombu's client).

``send_task`` with ``confirm_publish`` waits for each confirm in turn. Here ``submit`` writes a
whole batch on one channel in confirm mode (mandatory, persistent) and returns a ticket at once;
``collect`` reads frames until each of its delivery tags is settled or the publish timeout
passes. Several tickets may be outstanding; tags count from 1 on each new channel. The tags,
returns and nacks are tracked by ``rabbitmq_confirms.ConfirmTracker``, the RabbitMQ backend's own.

How each job's outcome is decided::

    basic.return ... basic.ack     -> REJECTED (unroutable: no queue of that name; RabbitMQ
                                      returns the message before it acks it)
    basic.ack (tag, or every tag <= it when multiple) -> PUBLISHED
    basic.nack                     -> RETRY
    channel closed by the broker   -> RETRY for the unconfirmed jobs
    connection lost / blocked (resource alarm) / no confirm within the publish timeout:
        the connection is dropped; nothing of the ticket confirmed -> BackendUnavailable
                                   some confirmed                  -> PUBLISHED those, RETRY the rest

Heartbeats are off (this client only reads inside ``collect``); a connection idle longer than
``IDLE_RECONNECT_S`` is replaced before the next batch, so nothing is written on a socket a broker
restart left dead. Errors never carry the URL or the password.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import amqp
import amqp.exceptions

from drain import backend, errors, models
from drain_adapters import celery_message, rabbitmq_confirms

log = logging.getLogger(__name__)

IDLE_RECONNECT_S = 30.0
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # py-amqp writes integers as at most 64-bit signed
MAX_TABLE_DEPTH = 100
CLOSE_TIMEOUT_S = 2.0
# What a broken connection raises in py-amqp: the socket's errors and its own recoverable ones.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    EOFError,
    amqp.exceptions.RecoverableConnectionError,
    amqp.exceptions.ConnectionError,
)


@dataclasses.dataclass(frozen=True)
class AmqpAddress:
    """Where the broker is, parsed as kombu parses a Celery ``broker_url``."""

    host: str
    port: int
    userid: str
    password: str
    virtual_host: str
    ssl: bool

    @classmethod
    def parse(cls, url: str) -> AmqpAddress:
        """Raise ValueError for a URL that is not amqp://, amqps:// or pyamqp://."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("amqp", "amqps", "pyamqp"):
            raise ValueError("must be an amqp://, amqps:// or pyamqp:// URL")
        ssl = parts.scheme == "amqps"
        path = parts.path[1:] if parts.path.startswith("/") else parts.path
        return cls(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or (5671 if ssl else 5672),
            userid=urllib.parse.unquote(parts.username or "guest"),
            password=urllib.parse.unquote(parts.password or "guest"),
            virtual_host=urllib.parse.unquote(path) or "/",
            ssl=ssl,
        )


Wire = tuple[celery_message.CeleryMessage, amqp.Message]


def _table_problem(value: Any, depth: int = 0) -> str | None:
    """Why py-amqp could not write ``value`` (a JSON value) in a header table, or None."""
    if depth > MAX_TABLE_DEPTH:
        return "nested too deeply"
    if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
        return None
    if isinstance(value, int):
        return None if INT64_MIN <= value <= INT64_MAX else f"integer {value} does not fit 64 bits"
    if isinstance(value, list):
        return next((p for item in value if (p := _table_problem(item, depth + 1))), None)
    if isinstance(value, dict):
        for key, item in value.items():
            if len(str(key).encode()) > celery_message.MAX_SHORTSTR_BYTES:
                return "a header name is longer than 255 bytes"
            problem = _table_problem(item, depth + 1)
            if problem:
                return problem
        return None
    return f"a {type(value).__name__} value"


def wire(message: celery_message.CeleryMessage) -> Wire:
    """The AMQP message kombu's ``prepare_message`` makes of it. The row's own headers are
    checked to fit an AMQP table (Celery's are always encodable), so a row that cannot be
    written is refused before the batch is; ``submit`` keeps a net behind this check."""
    problem = _table_problem(message.job.options.get("headers") or {})
    if problem:
        raise errors.JobRefused(f"AMQP cannot carry the headers option: {problem}")
    properties = dict(message.properties)
    built = amqp.Message(
        message.body,
        priority=properties.pop("priority"),
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        application_headers=message.headers,
        **properties,
    )
    return message, built


Ticket = rabbitmq_confirms.Ticket  # a submitted batch whose confirms are outstanding


class AmqpPublisher:
    """Publish Celery messages with pipelined publisher confirms; see the module docstring."""

    def __init__(
        self, name: str, address: AmqpAddress, *, publish_timeout_s: float, connect_timeout_s: float
    ):
        self.name = name
        self.address = address
        self.publish_timeout_s = publish_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._connection: amqp.Connection | None = None
        self._channel: Any = None
        self._confirms = rabbitmq_confirms.ConfirmTracker("celery")  # by delivery tag; task id = job id
        self._blocked = False
        self._last_io = 0.0

    # --- connection life ------------------------------------------------------------------------

    def open(self) -> None:
        """Connect and open a channel in confirm mode; raise BackendUnavailable when not possible."""
        self._drop("the connection was replaced")
        address = self.address
        connection = amqp.Connection(
            host=f"{address.host}:{address.port}",
            userid=address.userid,
            password=address.password,
            virtual_host=address.virtual_host,
            ssl=address.ssl,
            connect_timeout=self.connect_timeout_s,
            read_timeout=self.publish_timeout_s,
            write_timeout=self.publish_timeout_s,
            heartbeat=0,
            on_blocked=self._on_blocked,
            on_unblocked=self._on_unblocked,
        )
        try:
            connection.connect()
            self._connection = connection
            self._open_channel()
        except Exception as exc:  # noqa: BLE001 - any failure to connect is the backend's
            self._drop("connecting failed")
            raise self._unavailable(exc) from None
        self._last_io = time.monotonic()

    def _open_channel(self) -> None:
        assert self._connection is not None
        channel = self._connection.channel()
        channel.confirm_select()
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        channel.events["basic_return"].add(self._on_return)
        self._confirms.restart()  # tags restart at 1
        self._channel = channel

    def ping(self) -> None:
        """Raise BackendUnavailable unless the broker answers (reconnecting when needed)."""
        self._ensure_ready()
        try:
            assert self._connection is not None
            self._connection.send_heartbeat()
            self._read(0.0)
        except CONNECTION_ERRORS as exc:
            self._drop("ping failed")
            raise self._unavailable(exc) from None
        if self._blocked:
            self._drop("blocked")
            raise self._unavailable("the broker blocks publishing (resource alarm)")

    def close(self) -> None:
        """Close politely (bounded), then drop the socket. Idempotent."""
        connection = self._connection
        if connection is not None:
            try:
                with connection.transport.having_timeout(CLOSE_TIMEOUT_S):
                    connection.close()
            except Exception as exc:  # noqa: BLE001 - closing a broken connection may fail
                log.debug(
                    "backend %s: closing failed: %s",
                    self.name,
                    type(exc).__name__,
                    extra={"backend": self.name},
                )
        self._drop("the connection was closed")

    def _ensure_ready(self) -> None:
        stale = time.monotonic() - self._last_io > IDLE_RECONNECT_S
        if self._connection is None or self._blocked or stale:
            self.open()
        elif self._channel is None or not self._channel.is_open:
            try:
                self._open_channel()
            except (*CONNECTION_ERRORS, amqp.exceptions.AMQPError) as exc:
                self._drop("opening a channel failed")
                raise self._unavailable(exc) from None

    def _drop(self, reason: str) -> None:
        """Forget the connection without waiting: unconfirmed jobs stay unconfirmed."""
        self._confirms.abandon(reason, retry=False)
        connection, self._connection = self._connection, None
        self._channel = None
        self._blocked = False
        if connection is not None:
            try:
                connection.collect()
            except Exception as exc:  # noqa: BLE001
                log.debug(
                    "backend %s: dropping the connection: %s",
                    self.name,
                    type(exc).__name__,
                    extra={"backend": self.name},
                )

    # --- publishing -------------------------------------------------------------------------------

    def submit(self, messages: Sequence[Wire], ticket: Ticket) -> Ticket:
        """Write the messages (mandatory) and return at once; ``collect`` waits for their confirms.

        Raises BackendUnavailable when there is no connection to publish on.
        """
        if not messages:
            return ticket
        self._ensure_ready()
        channel = self._channel
        try:
            for message, built in messages:
                try:
                    channel.basic_publish(built, message.exchange, message.routing_key, mandatory=True)
                except CONNECTION_ERRORS:
                    raise
                except Exception as exc:  # noqa: BLE001 - the net: py-amqp encodes the whole frame
                    # before writing it, so nothing of this one reached the socket: its rejection.
                    reason = backend.refusal_text("celery", exc, with_type=True)
                    ticket.results.append(models.PublishResult.rejected(message.job, reason))
                    continue
                self._confirms.sent(ticket, message.job)
        except CONNECTION_ERRORS as exc:
            # Settled in collect: what was written may still be confirmed before the socket died.
            log.debug(
                "backend %s: publishing failed: %s",
                self.name,
                type(exc).__name__,
                extra={"backend": self.name},
            )
            self._drop(f"publishing failed: {type(exc).__name__}")
        self._last_io = time.monotonic()
        return ticket

    def collect(self, ticket: Ticket) -> list[models.PublishResult]:
        """Wait up to the publish timeout for the ticket's confirms; one result per job."""
        deadline = time.monotonic() + self.publish_timeout_s
        while ticket.pending and ticket.lost is None:
            remaining = deadline - time.monotonic()
            if self._blocked or remaining <= 0:
                why = (
                    "the broker blocks publishing (resource alarm)" if self._blocked else "no confirm in time"
                )
                self._drop(why)
                break
            try:
                self._read(remaining)
            except amqp.exceptions.ChannelError as exc:
                # The broker closed the channel (the connection lives): the jobs it carried retry.
                self._channel = None
                self._confirms.abandon(f"channel closed: {type(exc).__name__}: {exc.reply_text}", retry=True)
            except CONNECTION_ERRORS as exc:
                self._drop(f"connection lost: {type(exc).__name__}")
        self._last_io = time.monotonic()
        results, down = rabbitmq_confirms.close_out(ticket, "celery")
        if down is not None:
            raise self._unavailable(down)
        return results

    def _read(self, timeout_s: float) -> None:
        """Handle the frames that arrive within ``timeout_s`` (at least one pass)."""
        connection = self._connection
        if connection is None:
            raise amqp.exceptions.RecoverableConnectionError("not connected")
        with contextlib.suppress(TimeoutError):  # socket.timeout: nothing more arrived in time
            connection.drain_events(timeout=timeout_s)

    # --- py-amqp callbacks (run inside drain_events) ------------------------------------------------

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._confirms.confirmed(delivery_tag, multiple=multiple, acked=True)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._confirms.confirmed(delivery_tag, multiple=multiple, acked=False)

    def _on_return(self, exc: Any, exchange: str, routing_key: str, message: Any) -> None:
        task_id = message.properties.get("correlation_id")
        self._confirms.returned(
            str(task_id),
            f"unroutable: {getattr(exc, 'reply_code', '?')} {getattr(exc, 'reply_text', exc)} "
            f"(exchange {exchange!r}, routing key {routing_key!r}: no queue of that name)",
        )

    def _on_blocked(self, reason: Any) -> None:
        log.warning(
            "backend %s: the broker blocks publishing (memory or disk alarm)",
            self.name,
            extra={"event": "broker_blocked", "backend": self.name},
        )
        self._blocked = True

    def _on_unblocked(self) -> None:
        self._blocked = False

    def _unavailable(self, error: BaseException | str) -> errors.BackendUnavailable:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if self.address.password:
            text = text.replace(self.address.password, "***")
        return errors.BackendUnavailable(f"celery backend {self.name} (amqp): {text}"[:500])
