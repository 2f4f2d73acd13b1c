"""The RabbitMQ backend: each staged job becomes one persistent AMQP message, confirmed by the broker.

What a consumer receives (SPEC §7): a message published to ``exchange`` (the default exchange
``""`` unless configured) with routing key = the row's ``queue``, ``delivery_mode=2``,
``message_id=job_id``, ``type=job_name``, ``content_type=application/json`` and the body
``{"job_id", "job_name", "args", "kwargs", "queue", "created_at", "options"}``. Row options:
``priority`` (0-255), ``expiration`` (milliseconds) and ``headers`` (an object); any other option
makes that job REJECTED.

Why pika's SelectConnection, driven by hand: waiting for each confirm (BlockingConnection with
``confirm_delivery``) is latency-bound at about 1.7k msg/s here. Instead ``submit`` writes a batch
on one channel in confirm mode, mandatory, runs one pass of the connection's I/O loop to hand the
frames to the socket, and returns a ticket; ``collect`` runs the loop until every delivery tag of
that ticket is settled or the publish timeout passes. The relay keeps several tickets outstanding
(``pipeline_depth``) so the broker persists one batch while the relay reads the next.
``publish_batch`` is ``collect(submit(...))``. The loop only runs inside ``open``, ``ping``,
``submit``, ``collect`` and ``close`` (one thread, no background thread). With a named exchange,
``open`` checks that it exists (a passive declare) unless ``declare = true`` creates it.

How each job's outcome is decided, per delivery tag (tags count from 1 on each new channel)::

    basic.return (NO_ROUTE) ... basic.ack  -> REJECTED  (RabbitMQ acks unroutable messages; the
                                                        return always arrives before the ack)
    basic.ack (tag, or every tag <= it when multiple)   -> PUBLISHED
    basic.nack                                          -> RETRY
    channel closed by the broker (406, ...)             -> RETRY for the unconfirmed jobs
    channel closed with 404 (the exchange is gone)      -> as a lost connection, below
    connection lost / blocked (alarm) / no confirm within publish_timeout_s:
        the connection is torn down; nothing confirmed yet -> BackendUnavailable (rows untouched)
                                     some confirmed       -> PUBLISHED for those, RETRY the rest

A blocked connection (memory or disk alarm) fails the batch at once rather than holding the
database transaction open; the relay pauses the backend and retries with backoff. Heartbeats are
only serviced while the loop runs, so a connection idle for more than half the heartbeat is
replaced before the next batch (publishing nothing on a possibly dead socket). The adapter never
logs a message body, and no URL or password appears in its errors.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pika
import pika.channel
import pika.exceptions
import pika.spec

from drain import config, errors, models, options

log = logging.getLogger(__name__)

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_HEARTBEAT_S = 60
DEFAULT_MAX_MESSAGE_BYTES = 134_217_728  # RabbitMQ's max_message_size default (3.x)
CLOSE_TIMEOUT_S = 5.0
EXCHANGE_TYPES = ("direct", "topic", "fanout", "headers")
KNOWN_OPTIONS = ("priority", "expiration", "headers")


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
        if settings.queues and not settings.declare:
            reader.problem("queues", "is only used with declare = true")
        problems = reader.finish()
        if problems:
            raise errors.ConfigError(problems)
        return settings


def _body(job: models.StagedJob) -> bytes:
    return json.dumps(
        {
            "job_id": str(job.job_id),
            "job_name": job.job_name,
            "args": list(job.args),
            "kwargs": dict(job.kwargs),
            "queue": job.queue,
            "created_at": job.created_at.isoformat(),
            "options": dict(job.options),
        },
        separators=(",", ":"),
    ).encode()


def _properties(job: models.StagedJob) -> pika.BasicProperties | str:
    """The message properties, or the reason the job's options are refused."""
    opts = job.options
    unknown = sorted(set(opts) - set(KNOWN_OPTIONS))
    if unknown:
        return f"unknown RabbitMQ option(s) {', '.join(unknown)} (known: {', '.join(KNOWN_OPTIONS)})"
    priority = opts.get("priority")
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255
    ):
        return f"RabbitMQ option priority must be an integer 0-255, not {priority!r}"
    expiration = opts.get("expiration")
    if expiration is not None:
        if isinstance(expiration, str) and expiration.isdigit():
            expiration = int(expiration)
        if isinstance(expiration, bool) or not isinstance(expiration, int) or expiration < 0:
            return f"RabbitMQ option expiration must be a number of milliseconds, not {expiration!r}"
    headers = opts.get("headers")
    if headers is not None and not isinstance(headers, dict):
        return "RabbitMQ option headers must be an object"
    return pika.BasicProperties(
        content_type="application/json",
        delivery_mode=pika.DeliveryMode.Persistent,
        message_id=str(job.job_id),
        type=job.job_name,
        timestamp=int(job.created_at.timestamp()),
        priority=priority,
        expiration=None if expiration is None else str(expiration),
        headers=headers,
    )


@dataclasses.dataclass(eq=False)
class Ticket:
    """A submitted batch whose confirms are outstanding (see ``RabbitMQAdapter.submit``)."""

    pending: dict[int, models.StagedJob] = dataclasses.field(default_factory=dict)
    results: list[models.PublishResult] = dataclasses.field(default_factory=list)
    confirmed: bool = False
    lost: str | None = None  # why its channel went away; None while the channel lives
    lost_retry: bool = False


class RabbitMQAdapter:
    """Publish staged jobs to RabbitMQ with publisher confirms; see the module docstring."""

    def __init__(self, name: str, settings: RabbitMQSettings) -> None:
        self.name = name
        self.settings = settings
        self._secret = urllib.parse.urlsplit(settings.url).password or None
        self._connection: pika.SelectConnection | None = None
        self._channel: pika.channel.Channel | None = None
        self._ready = False
        self._failure: str | None = None
        self._channel_error: str | None = None
        self._blocked = False
        self._last_io = 0.0
        self._predicate: Callable[[], bool] | None = None
        self._declaring = 0
        self._next_tag = 1
        self._tickets: dict[int, Ticket] = {}  # delivery tag -> its ticket, in tag order
        self._returned: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"RabbitMQAdapter({self.name!r}, {self.settings!r})"

    @classmethod
    def from_options(
        cls, name: str, options_: Mapping[str, Any], *, publish_timeout_s: float
    ) -> RabbitMQAdapter:
        return cls(name, RabbitMQSettings.parse(name, options_, publish_timeout_s))

    # --- the Adapter protocol ---------------------------------------------------------------

    def open(self) -> None:
        """Connect, open a channel in confirm mode and declare the topology if asked."""
        self.close()
        self._failure = None
        self._blocked = False
        parameters = pika.URLParameters(self.settings.url)
        parameters.heartbeat = self.settings.heartbeat_s
        parameters.blocked_connection_timeout = self.settings.publish_timeout_s
        parameters.socket_timeout = self.settings.connect_timeout_s
        parameters.stack_timeout = self.settings.connect_timeout_s
        parameters.connection_attempts = 1
        try:
            self._connection = pika.SelectConnection(
                parameters,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_connection_closed,
            )
            self._run_until(lambda: self._ready or self._failure is not None, self.settings.connect_timeout_s)
            if not self._ready:
                raise self._unavailable(self._failure or "no connection within connect_timeout_s")
            if self.settings.declare or self.settings.exchange:
                self._declare()
        except errors.BackendUnavailable:
            self._teardown()
            raise
        except Exception as exc:  # noqa: BLE001 - pika raises many types; none may leak the URL
            self._teardown()
            raise self._unavailable(self._describe(exc)) from None

    def ping(self) -> None:
        """Raise BackendUnavailable unless the connection is usable (reconnecting if it dropped)."""
        self._ensure_ready()
        self._run_until(lambda: False, 0.0)
        if self._failure is not None or self._blocked:
            reason = self._failure or "the broker blocks publishing (resource alarm)"
            self._teardown()
            raise self._unavailable(reason)

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        return self.collect(self.submit(jobs))

    def submit(self, jobs: Sequence[models.StagedJob], /) -> Ticket:
        """Write the batch to the broker and return at once; ``collect`` waits for its confirms.

        Jobs refused before publishing (bad options, too big) are settled in the ticket already.
        Several tickets may be outstanding on the channel; each is collected on its own. Raises
        BackendUnavailable when there is no connection to publish on.
        """
        ticket = Ticket()
        messages: list[tuple[models.StagedJob, bytes, pika.BasicProperties]] = []
        for job in jobs:
            properties = _properties(job)
            if isinstance(properties, str):
                ticket.results.append(models.PublishResult.rejected(job, properties))
                continue
            body = _body(job)
            if len(body) > self.settings.max_message_bytes:
                reason = f"message of {len(body)} bytes exceeds max_message_bytes"
                ticket.results.append(models.PublishResult.rejected(job, reason))
                continue
            messages.append((job, body, properties))
        if not messages:
            return ticket
        self._ensure_ready()
        channel = self._channel
        assert channel is not None
        try:
            for job, body, properties in messages:
                channel.basic_publish(self.settings.exchange, job.queue, body, properties, mandatory=True)
                ticket.pending[self._next_tag] = job
                self._tickets[self._next_tag] = ticket
                self._next_tag += 1
            # One pass of the I/O loop hands the frames to the socket, so the broker works on
            # them while the caller does something else; their confirms wait in the socket.
            self._run_until(lambda: False, 0.0)
        except Exception as exc:  # noqa: BLE001 - translated in collect, without the URL
            self._failure = self._failure or self._describe(exc)
        return ticket

    def collect(self, ticket: Ticket, /) -> list[models.PublishResult]:
        """Wait (up to publish_timeout_s) for the ticket's confirms; one result per job.

        Raises BackendUnavailable when nothing of it was confirmed and the broker failed.
        """
        if ticket.pending and ticket.lost is None:
            try:
                self._run_until(lambda: self._ticket_done(ticket), self.settings.publish_timeout_s)
            except Exception as exc:  # noqa: BLE001 - translated below, without the URL
                self._failure = self._failure or self._describe(exc)
        if ticket.pending and ticket.lost is None:
            # Still on the live channel and unconfirmed: say why, and give up on the connection
            # unless only the channel closed.
            if self._channel_error is not None and self._connection_usable():
                self._abandon(f"channel closed: {self._channel_error}", retry=True)
            else:
                self._failure = self._failure or (
                    "the broker blocks publishing (resource alarm)"
                    if self._blocked
                    else f"no confirm within {self.settings.publish_timeout_s}s"
                )
                self._teardown()
        results = ticket.results
        if not ticket.pending:
            return results
        unsettled = list(ticket.pending.values())
        ticket.pending = {}
        reason = ticket.lost or "the channel was closed"
        if not ticket.lost_retry and not ticket.confirmed:
            raise self._unavailable(reason)
        results.extend(models.PublishResult.retry(job, f"rabbitmq: {reason}") for job in unsettled)
        return results

    def close(self) -> None:
        """Close the connection politely (bounded), then release it. Idempotent."""
        connection = self._connection
        if connection is not None and connection.is_open:
            try:
                connection.close()
                self._run_until(lambda: connection.is_closed, CLOSE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - closing a broken connection may fail
                log.debug("backend %s: closing failed: %s", self.name, type(exc).__name__)
        self._teardown()

    # --- connection life ----------------------------------------------------------------------

    def _ensure_ready(self) -> None:
        idle_limit = self.settings.heartbeat_s / 2 if self.settings.heartbeat_s else float("inf")
        connection = self._connection
        if connection is None or not connection.is_open or self._failure is not None or self._blocked:
            self.open()
        elif time.monotonic() - self._last_io > idle_limit:
            log.debug("backend %s: reconnecting after an idle period", self.name)
            self.open()
        elif not self._ready:
            self._open_channel(connection)
            self._run_until(lambda: self._ready or self._failure is not None, self.settings.connect_timeout_s)
            if not self._ready:
                self._teardown()
                raise self._unavailable(self._failure or "no channel within connect_timeout_s")

    def _abandon(self, reason: str, *, retry: bool) -> None:
        """The channel that carried the outstanding tickets is gone: their unconfirmed jobs
        will never be confirmed. ``retry``: only the channel failed (the jobs RETRY); otherwise
        the connection did (a ticket with nothing confirmed makes the backend unavailable)."""
        for ticket in self._tickets.values():
            if ticket.lost is None:
                ticket.lost = reason
                ticket.lost_retry = retry
        self._tickets = {}
        self._returned = {}

    def _connection_usable(self) -> bool:
        connection = self._connection
        return connection is not None and connection.is_open and self._failure is None and not self._blocked

    def _teardown(self) -> None:
        self._abandon(self._failure or "the connection was closed", retry=False)
        connection, self._connection = self._connection, None
        self._channel = None
        self._ready = False
        if connection is None:
            return
        try:
            if not connection.is_closed:
                connection._adapter_disconnect()  # drop the socket: unconfirmed jobs stay unconfirmed
            connection.ioloop.close()
        except Exception as exc:  # noqa: BLE001
            log.debug("backend %s: teardown: %s", self.name, type(exc).__name__)

    def _run_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Run the I/O loop until ``predicate()`` holds or ``timeout_s`` passed."""
        connection = self._connection
        if connection is None:
            return
        loop = connection.ioloop
        if predicate():
            return
        self._predicate = predicate
        timer = loop.call_later(timeout_s, loop.stop)
        try:
            loop.start()
        finally:
            self._predicate = None
            loop.remove_timeout(timer)
            self._last_io = time.monotonic()

    def _wake(self) -> None:
        if self._predicate is not None and self._predicate() and self._connection is not None:
            self._connection.ioloop.stop()

    def _ticket_done(self, ticket: Ticket) -> bool:
        return (
            not ticket.pending
            or ticket.lost is not None
            or self._failure is not None
            or self._blocked
            or not self._ready
        )

    def _declare(self) -> None:
        """Declare the topology (``declare = true``), or check that the named exchange exists
        (a passive declare): publishing to a missing exchange would close the channel."""
        channel = self._channel
        assert channel is not None
        exchange = self.settings.exchange
        passive = not self.settings.declare

        def done(_frame: Any) -> None:
            self._declaring -= 1
            self._wake()

        self._declaring = 1 if exchange else 0
        if exchange:
            channel.exchange_declare(
                exchange,
                exchange_type=self.settings.exchange_type,
                durable=True,
                passive=passive,
                callback=done,
            )
        for queue in () if passive else self.settings.queues:
            self._declaring += 1
            channel.queue_declare(queue, durable=True, callback=done)
            if exchange:
                self._declaring += 1
                channel.queue_bind(queue, exchange, routing_key=queue, callback=done)
        self._run_until(
            lambda: self._declaring == 0 or not self._ready or self._failure is not None,
            self.settings.connect_timeout_s,
        )
        if self._declaring:
            reason = self._failure or self._channel_error or "timed out"
            what = (
                f"the exchange {exchange!r} is missing or unusable"
                if passive
                else "declaring the topology failed"
            )
            raise self._unavailable(f"{what}: {reason}")

    # --- pika callbacks (run inside the loop) -------------------------------------------------

    def _on_connection_open(self, connection: pika.SelectConnection) -> None:
        connection.add_on_connection_blocked_callback(self._on_blocked)
        connection.add_on_connection_unblocked_callback(self._on_unblocked)
        self._open_channel(connection)

    def _open_channel(self, connection: pika.SelectConnection) -> None:
        self._channel_error = None
        connection.channel(on_open_callback=self._on_channel_open)

    def _on_channel_open(self, channel: pika.channel.Channel) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_confirm_mode)

    def _on_confirm_mode(self, _frame: Any) -> None:
        self._abandon("the channel was replaced", retry=True)  # tags restart at 1
        self._next_tag = 1
        self._ready = True
        self._wake()

    def _on_open_error(self, _connection: Any, error: BaseException | str) -> None:
        self._failure = self._describe(error)
        self._wake()

    def _on_connection_closed(self, _connection: Any, reason: BaseException) -> None:
        self._failure = f"connection closed: {self._describe(reason)}"
        self._ready = False
        self._wake()

    def _on_channel_closed(self, channel: pika.channel.Channel, reason: BaseException) -> None:
        if channel is not self._channel:
            return
        self._channel = None
        self._ready = False
        self._channel_error = self._describe(reason)
        if isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            # 404: the exchange is gone, which fails every job alike: the backend is unavailable
            # (paused, drain_backend_up 0) rather than each job retried forever.
            self._abandon(f"channel closed: {self._channel_error}", retry=reason.reply_code != 404)
        self._wake()

    def _on_blocked(self, _connection: Any, _frame: Any) -> None:
        log.warning("backend %s: the broker blocks publishing (memory or disk alarm)", self.name)
        self._blocked = True
        self._wake()

    def _on_unblocked(self, _connection: Any, _frame: Any) -> None:
        self._blocked = False

    def _on_return(
        self,
        _channel: Any,
        method: pika.spec.Basic.Return,
        properties: pika.BasicProperties,
        _body: bytes,
    ) -> None:
        self._returned[str(properties.message_id)] = (
            f"unroutable: {method.reply_code} {method.reply_text} "
            f"(exchange {method.exchange!r}, routing key {method.routing_key!r})"
        )

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        tag: int = method.delivery_tag
        # tags are in order: a multiple confirm settles every outstanding tag up to ``tag``
        tags = list(itertools.takewhile(lambda t: t <= tag, self._tickets)) if method.multiple else [tag]
        for t in tags:
            ticket = self._tickets.pop(t, None)
            job = None if ticket is None else ticket.pending.pop(t, None)
            if ticket is None or job is None:
                continue
            ticket.confirmed = True
            if not acked:
                ticket.results.append(models.PublishResult.retry(job, "rabbitmq: the broker nacked it"))
                continue
            returned = self._returned.pop(str(job.job_id), None)
            if returned is None:
                ticket.results.append(models.PublishResult.published(job))
            else:
                ticket.results.append(models.PublishResult.rejected(job, f"rabbitmq: {returned}"))
        self._wake()

    # --- errors ---------------------------------------------------------------------------------

    def _describe(self, error: BaseException | str) -> str:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {str(error) or repr(error)}"
        if self._secret:
            text = text.replace(self._secret, "***")
        return text.replace(self.settings.url, config.redact_url(self.settings.url))

    def _unavailable(self, reason: str) -> errors.BackendUnavailable:
        return errors.BackendUnavailable(f"rabbitmq backend {self.name}: {self._describe(reason)}")
