"""Celery messages onto RabbitMQ with many publisher confirms outstanding (py-amqp, kombu's client).

``send_task`` with ``confirm_publish`` waits for each confirm in turn. Here ``submit`` writes a
whole batch on one channel in confirm mode (mandatory, persistent) and returns a ticket at once;
``collect`` reads frames until each of its delivery tags is settled or the publish timeout
passes. Several tickets may be outstanding; tags count from 1 on each new channel. The tags,
returns and nacks are tracked by ``amqp_confirms.ConfirmTracker``, the RabbitMQ backend's own.

Before the first publish to a queue on a connection, the queue is declared as ``send_task``
declares it with Celery's defaults (``celery_queues``: the exchange, the queue and the binding,
on a channel of their own), so a queue no worker declared yet is created and its jobs wait in
it; a queue that exists with other arguments (PRECONDITION_FAILED) is used as it is.

Before a batch is risked on a new connection, a probe proves the broker takes publishes: one tiny
message, not mandatory, to the default exchange with a routing key no queue can have (``amq.``
names are the broker's), confirmed within what is left of the connect timeout (PROBE_MIN_S at
least). A broker under a memory or disk alarm stops reading at that probe and sends
``connection.blocked``: the connection is dropped and the backend is unavailable, and no batch
sits in the broker's buffers to be delivered again when the alarm clears.

How each job's outcome is decided::

    basic.return ... basic.ack     -> REJECTED (unroutable: no queue of that name; RabbitMQ
                                      returns the message before it acks it), or RETRY when
                                      the drain declared that queue on this connection (it was
                                      deleted since: declared again before the next batch)
    basic.ack (tag, or every tag <= it when multiple) -> PUBLISHED
    basic.nack                     -> RETRY
    channel closed over a message's size (406 "message size N is larger than max size M")
                                   -> REJECTED for the jobs over M, RETRY for the others
    channel closed by the broker   -> RETRY for the unconfirmed jobs (also when py-amqp reads
                                      the close inside a later ``basic_publish``: RETRY for that
                                      job and the rest of the batch, never its rejection)
    connection lost / blocked (resource alarm) / no confirm within the publish timeout:
        the connection is dropped; nothing of the ticket confirmed -> BackendUnavailable
                                   some confirmed                  -> PUBLISHED those, RETRY the rest

Heartbeats are off (this client only reads inside ``collect``); a connection idle longer than
``IDLE_RECONNECT_S`` is replaced before the next batch, so nothing is written on a socket a broker
restart left dead. Errors never carry the URL or the password.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import amqp
import amqp.exceptions

from drain import backend, errors, models
from drain_adapters.amqp import confirms as amqp_confirms
from drain_adapters.amqp import names as amqp_names
from drain_adapters.amqp import nodes as amqp_nodes
from drain_adapters.celery import message as celery_message
from drain_adapters.celery import queues as celery_queues

LATE_DECLARATION = (
    "celery: not sent: its queue was not declared within half the publish timeout (too many new "
    "queues in one batch); sent with a later batch"
)
log = logging.getLogger(__name__)

IDLE_RECONNECT_S = 30.0
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # py-amqp writes integers as at most 64-bit signed
MAX_TABLE_DEPTH = 100
CLOSE_TIMEOUT_S = 2.0
PRECONDITION_FAILED = 406
MIN_READ_S = 0.05  # the last read of confirms already in the socket (0 would not block at all)
PROBE_ROUTING_KEY = "amq.drain.probe"  # on the default exchange: "amq." queue names are reserved
PROBE_BODY = b"drain probe"  # not empty: a blocked broker stops between its header and body
PROBE_MIN_S = 1.0  # the probe's wait when connecting took (nearly) all of the connect timeout
MAX_DECLARED_QUEUES = 10_000  # queue names remembered as declared per connection
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
    def parse_all(cls, url: str) -> tuple[AmqpAddress, ...]:
        """Each node of a ``;``-separated ``broker_url`` (kombu's failover spelling), in order."""
        return tuple(cls.parse(part.strip()) for part in url.split(";") if part.strip())

    @property
    def node(self) -> str:
        """``host:port``, safe to log."""
        return f"{self.host}:{self.port}"

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


class FramedMessage(amqp.Message):  # type: ignore[misc]  # py-amqp is untyped
    """An ``amqp.Message`` whose properties (the headers table among them) are encoded once, when
    it is built: their size is then known before it is sent (the content header frame must fit
    the connection's ``frame_max``), and py-amqp writes these very bytes instead of encoding them
    again. Nothing changes the properties after it is built."""

    __slots__ = ("encoded_properties",)

    def __init__(self, body: bytes, **properties: Any) -> None:
        super().__init__(body, **properties)
        self.encoded_properties: bytes = amqp.Message._serialize_properties(self)

    def _serialize_properties(self) -> bytes:
        return self.encoded_properties

    @property
    def header_frame_bytes(self) -> int:
        """The size of the content header frame carrying these properties."""
        return amqp_names.HEADER_FRAME_OVERHEAD_BYTES + len(self.encoded_properties)


Wire = tuple[celery_message.CeleryMessage, FramedMessage]


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
    """The AMQP message kombu's ``prepare_message`` makes of it. The routing key must name a
    queue a client may publish to (``amqp_names``: not empty, not ``amq.``), the row's own headers
    must fit an AMQP table (Celery's are always encodable) and route copies (``CC``, ``BCC``) only
    as RabbitMQ takes them; the properties are encoded here (``FramedMessage``), so a row that
    cannot be written is refused before the batch is. ``submit`` checks the header frame against
    the connection's ``frame_max`` and keeps a net behind these checks."""
    row_headers = message.job.options.get("headers") or {}
    problem = (
        amqp_names.queue_name_problem(message.routing_key)
        if message.exchange == amqp_names.DEFAULT_EXCHANGE
        else None
    )
    problem = problem or amqp_names.routed_copies_problem(row_headers, message.exchange)
    if problem:
        raise errors.JobRefused(problem)
    problem = _table_problem(row_headers)
    if problem:
        raise errors.JobRefused(f"AMQP cannot carry the headers option: {problem}")
    properties = dict(message.properties)
    built = FramedMessage(
        message.body,
        priority=properties.pop("priority"),
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        application_headers=message.headers,
        **properties,
    )
    return message, built


Ticket = amqp_confirms.Ticket  # a submitted batch whose confirms are outstanding


class AmqpPublisher:
    """Publish Celery messages with pipelined publisher confirms; see the module docstring."""

    def __init__(
        self,
        name: str,
        addresses: Sequence[AmqpAddress],
        *,
        publish_timeout_s: float,
        connect_timeout_s: float,
        declarations: Callable[[str], celery_queues.Declaration | None] = lambda _name: None,
    ):
        """``declarations(queue)``: what to declare before the first publish to ``queue`` on a
        connection (``celery_queues.of``), or None for nothing."""
        self.name = name
        self.addresses = tuple(addresses)
        self.nodes = amqp_nodes.NodeRotation(len(self.addresses))
        self.publish_timeout_s = publish_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._connection: amqp.Connection | None = None
        self._channel: Any = None
        self._confirms = amqp_confirms.ConfirmTracker("celery")  # by delivery tag; task id = job id
        self._blocked = False
        self._last_io = 0.0
        self._node: int | None = None  # the node last connected to
        self._broker_max_bytes: int | None = None  # max_message_size, once the broker refused one
        self._declarations = declarations
        self._declared: set[str] = set()  # queues declared (or found existing) on this connection
        self._undeclared: set[str] = set()  # queues not declared on this connection (refused, none)
        self._gone: set[str] = set()  # declared queues found deleted, to declare again
        self._declare_channel: Any = None
        self._warned: set[str] = set()  # queues whose refused declaration was logged

    # --- connection life ------------------------------------------------------------------------

    def open(self) -> None:
        """Connect to the first node that answers (the nodes share the connect timeout, see
        ``amqp_nodes``) and open a channel in confirm mode; raise BackendUnavailable when none does."""
        self._drop("the connection was replaced", failed=False)
        failures: list[str] = []
        started = time.monotonic()
        for index, left_s in self.nodes.attempts(self.connect_timeout_s):
            address = self.addresses[index]
            connection = amqp.Connection(
                host=address.node,
                userid=address.userid,
                password=address.password,
                virtual_host=address.virtual_host,
                ssl=address.ssl,
                connect_timeout=left_s,
                read_timeout=self.publish_timeout_s,
                write_timeout=self.publish_timeout_s,
                heartbeat=0,
                on_blocked=self._on_blocked,
                on_unblocked=self._on_unblocked,
            )
            self._broker_max_bytes = None
            try:
                connection.connect()
                self._connection = connection
                self._open_channel()
                self._prove(max(PROBE_MIN_S, started + self.connect_timeout_s - time.monotonic()))
            except errors.BackendUnavailable:
                self._drop("the broker does not take publishes")
                raise
            except Exception as exc:  # noqa: BLE001 - any failure to connect is the backend's
                self._connection = connection  # dropped (closed) below
                self._drop("connecting failed", failed=False)
                self.nodes.failed(index)
                reason = f"{type(exc).__name__}: {exc}"
                failures.append(f"{address.node}: {reason}" if len(self.addresses) > 1 else reason)
                continue
            self._connected(index)
            self._last_io = time.monotonic()
            return
        raise self._unavailable("; ".join(failures) or "no node within the connect timeout")

    def _connected(self, index: int) -> None:
        """Remember the node; say so when the drain moved to another node of a cluster."""
        if len(self.addresses) > 1 and index != self._node:
            log.info(
                "backend %s: connected to %s (node %d of %d)",
                self.name,
                self.addresses[index].node,
                index + 1,
                len(self.addresses),
                extra={"event": "broker_node", "backend": self.name, "node": self.addresses[index].node},
            )
        self._node = index
        self.nodes.connected(index)

    def _open_channel(self) -> None:
        assert self._connection is not None
        channel = self._connection.channel()
        channel.confirm_select()
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        channel.events["basic_return"].add(self._on_return)
        self._confirms.restart()  # tags restart at 1
        self._channel = channel

    def _prove(self, timeout_s: float | None = None) -> None:
        """Publish the probe and wait for its confirm, at most ``timeout_s`` (the connect timeout
        by default; see the module docstring); raise BackendUnavailable when the broker blocks,
        nacks it or stays silent."""
        timeout_s = self.connect_timeout_s if timeout_s is None else timeout_s
        assert self._channel is not None
        self._channel.basic_publish(amqp.Message(PROBE_BODY, delivery_mode=1), "", PROBE_ROUTING_KEY)
        self._confirms.probe_sent()
        deadline = time.monotonic() + timeout_s
        while self._confirms.probe is None and not self._blocked:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._unavailable(f"no confirm of a probe within {timeout_s:.1f}s")
            try:
                self._read(remaining)
            except amqp.exceptions.ChannelError:
                # Answered with a channel close (no write access to the default exchange): the
                # broker read it, which proves the same. py-amqp revived that channel without
                # confirm mode: publish on a new one.
                self._open_channel()
                return
        if self._blocked:
            raise self._unavailable("the broker blocks publishing (resource alarm)")
        if not self._confirms.probe:
            raise self._unavailable("the broker nacked a probe")

    def ping(self) -> None:
        """Raise BackendUnavailable unless the broker takes a publish now (reconnecting when
        needed): the connection answers and a probe is confirmed."""
        self._ensure_ready()
        try:
            assert self._connection is not None
            self._connection.send_heartbeat()
            self._read(0.0)
            if not self._blocked:
                self._prove()
        except CONNECTION_ERRORS as exc:
            self._drop("ping failed")
            raise self._unavailable(exc) from None
        except errors.BackendUnavailable:
            self._drop("the broker does not take publishes")
            raise
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
        self._drop("the connection was closed", failed=False)

    def _ensure_ready(self) -> None:
        """Reconnect after a failure, an alarm or an idle period; reopen a closed channel. What
        the broker sent meanwhile is read first (a ``connection.blocked``)."""
        stale = time.monotonic() - self._last_io > IDLE_RECONNECT_S
        if self._connection is not None and not self._blocked and not stale:
            try:
                self._read(0.0)
            except CONNECTION_ERRORS:
                self._drop("the connection was lost")
            except amqp.exceptions.ChannelError as exc:
                self._channel_closed(exc)  # reopened below
        if self._connection is None or self._blocked or stale:
            self.open()
        elif self._channel is None or not self._channel.is_open:
            try:
                self._open_channel()
            except (*CONNECTION_ERRORS, amqp.exceptions.AMQPError) as exc:
                self._drop("opening a channel failed")
                raise self._unavailable(exc) from None

    def _drop(self, reason: str, *, failed: bool = True) -> None:
        """Forget the connection without waiting: unconfirmed jobs stay unconfirmed. A
        connection dropped because it ``failed`` sends the next ``open`` to the next node first."""
        self._confirms.abandon(reason, retry=False)
        if failed:
            self.nodes.lost()
        else:
            self.nodes.closed()
        connection, self._connection = self._connection, None
        self._channel = None
        self._declare_channel = None
        self._declared.clear()
        self._undeclared.clear()
        self._gone.clear()
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
        if ticket.deadline is None:
            ticket.deadline = time.monotonic() + self.publish_timeout_s
        if not messages:
            return ticket
        self._ensure_ready()
        try:
            # At most half the publish timeout: a batch naming thousands of new queues (4-5 ms
            # each on loopback) outlived the session's fence (red team 25); the queues not
            # declared in time have their jobs retried, uncounted, with a later batch.
            declare_by = time.monotonic() + self.publish_timeout_s / 2
            late = self._declare_queues({message.routing_key for message, _built in messages}, declare_by)
        except CONNECTION_ERRORS as exc:
            self._drop(f"declaring a queue failed: {type(exc).__name__}")
            raise self._unavailable(exc) from None
        if self._blocked:  # the alarm began while declaring: write no batch into it
            self._drop("blocked")
            raise self._unavailable("the broker blocks publishing (resource alarm)")
        channel = self._channel
        assert self._connection is not None
        frame_max = int(self._connection.frame_max)  # as the broker tuned it on this connection
        try:
            for index, (message, built) in enumerate(messages):
                if message.routing_key in late:
                    ticket.results.append(models.PublishResult.retry(message.job, LATE_DECLARATION))
                    continue
                size = len(message.body)
                if self._broker_max_bytes is not None and size > self._broker_max_bytes:
                    reason = (
                        f"celery: message of {size} bytes exceeds the broker's max_message_size "
                        f"({self._broker_max_bytes})"
                    )
                    ticket.results.append(models.PublishResult.rejected(message.job, reason))
                    continue
                if built.header_frame_bytes > frame_max:
                    # The broker would close the connection, failing every job in flight.
                    reason = (
                        f"celery: its properties take {len(built.encoded_properties)} bytes encoded, "
                        f"more than one AMQP frame (frame_max {frame_max}); the headers (task name, "
                        "shadow, headers option) are too large"
                    )
                    ticket.results.append(models.PublishResult.rejected(message.job, reason))
                    continue
                try:
                    channel.basic_publish(built, message.exchange, message.routing_key, mandatory=True)
                except CONNECTION_ERRORS:
                    raise
                except amqp.exceptions.ChannelError as exc:
                    # The broker closed the channel over an earlier message, and py-amqp read that
                    # close here, before writing this one (it revives the channel without confirm
                    # mode): the channel's failure, not this message's. Every job of the batch
                    # not confirmed is retried; the next batch opens a new channel.
                    self._channel_closed(exc)
                    reason = f"celery: not sent: channel closed: {type(exc).__name__}: {exc.reply_text}"
                    ticket.results.extend(
                        models.PublishResult.retry(unsent.job, reason) for unsent, _ in messages[index:]
                    )
                    break
                except Exception as exc:  # noqa: BLE001 - the net: py-amqp encodes the whole frame
                    # before writing it, so nothing of this one reached the socket: its rejection.
                    reason = backend.refusal_text("celery", exc, with_type=True)
                    ticket.results.append(models.PublishResult.rejected(message.job, reason))
                    continue
                self._confirms.sent(ticket, message.job, size)
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
        """Wait for the ticket's confirms until the publish timeout after its submission (what
        already arrived is read even past it); one result per job."""
        while ticket.pending and ticket.lost is None:
            if self._blocked:
                self._drop("the broker blocks publishing (resource alarm)")
                break
            remaining = ticket.remaining_s(self.publish_timeout_s)
            try:
                if not self._read(max(remaining, MIN_READ_S)) and remaining <= MIN_READ_S:
                    self._drop("no confirm in time")
                    break
            except amqp.exceptions.ChannelError as exc:
                self._channel_closed(exc)
            except CONNECTION_ERRORS as exc:
                self._drop(f"connection lost: {type(exc).__name__}")
        self._last_io = time.monotonic()
        results, down = amqp_confirms.close_out(ticket, "celery")
        if down is not None:
            raise self._unavailable(down)
        return results

    def _channel_closed(self, exc: amqp.exceptions.ChannelError) -> None:
        """The broker closed the publishing channel (the connection lives): the jobs it carried
        retry, but for one over the broker's max_message_size: that one is refused."""
        self._channel = None
        limit = amqp_confirms.oversize_limit(str(exc.reply_text))
        if exc.reply_code == PRECONDITION_FAILED and limit is not None:
            self._broker_max_bytes = limit
            self._confirms.refuse_larger(limit, f"refused by the broker: {exc.reply_text}")
        else:
            reason = f"channel closed: {type(exc).__name__}: {exc.reply_text}"
            self._confirms.abandon(reason, retry=True)

    def _declare_queues(self, names: set[str], declare_by: float) -> set[str]:
        """Declare each queue not yet declared on this connection, as send_task would, until
        ``declare_by`` (monotonic); return those left undeclared for lack of time."""
        waiting = sorted(names - self._declared - self._undeclared)
        for index, name in enumerate(waiting):
            if time.monotonic() >= declare_by:
                return set(waiting[index:])
            declaration = self._declarations(name)
            if len(self._undeclared) >= MAX_DECLARED_QUEUES:
                self._undeclared.clear()  # forgetting only asks again
            if declaration is None:
                self._undeclared.add(name)
                continue
            outcome, why = celery_queues.declare(self._declaring_channel, declaration)
            if len(self._declared) >= MAX_DECLARED_QUEUES:
                self._declared.clear()  # forgetting only declares a queue again
            if outcome is celery_queues.Outcome.REFUSED:
                self._undeclared.add(name)
                if name not in self._warned and len(self._warned) < MAX_DECLARED_QUEUES:
                    self._warned.add(name)
                    log.warning(
                        "backend %s: could not declare queue %r (%s); its jobs are rejected "
                        "while no queue of that name exists",
                        self.name,
                        name,
                        why,
                        extra={"event": "queue_not_declared", "backend": self.name, "queue": name},
                    )
            else:
                self._declared.add(name)
                self._gone.discard(name)
        return set()

    def _declaring_channel(self) -> Any:
        """The channel declarations go on (not the one in confirm mode), opened when needed."""
        channel = self._declare_channel
        if channel is None or not channel.is_open:
            assert self._connection is not None
            channel = self._declare_channel = self._connection.channel()
        return channel

    def _read(self, timeout_s: float) -> bool:
        """Handle the next frame if one arrives within ``timeout_s``; say whether one did."""
        connection = self._connection
        if connection is None:
            raise amqp.exceptions.RecoverableConnectionError("not connected")
        try:
            connection.drain_events(timeout=timeout_s)
        except TimeoutError:  # socket.timeout: nothing arrived in time
            return False
        return True

    # --- py-amqp callbacks (run inside drain_events) ------------------------------------------------

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._confirms.confirmed(delivery_tag, multiple=multiple, acked=True)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._confirms.confirmed(delivery_tag, multiple=multiple, acked=False)

    def _on_return(self, exc: Any, exchange: str, routing_key: str, message: Any) -> None:
        task_id = message.properties.get("correlation_id")
        gone = exchange == "" and (routing_key in self._declared or routing_key in self._gone)
        if gone and routing_key in self._declared:  # deleted since: declare it again, then retry
            self._declared.discard(routing_key)
            self._gone.add(routing_key)
            log.warning(
                "backend %s: queue %r returned a message as unroutable (deleted?); declaring it again",
                self.name,
                routing_key,
                extra={"event": "queue_redeclared", "backend": self.name, "queue": routing_key},
            )
        self._confirms.returned(
            str(task_id),
            f"unroutable: {getattr(exc, 'reply_code', '?')} {getattr(exc, 'reply_text', exc)} "
            f"(exchange {exchange!r}, routing key {routing_key!r}: no queue of that name)"
            + ("; declaring it again" if gone else ""),
            retry=gone,
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
        for address in self.addresses:
            if address.password:
                text = text.replace(address.password, "***")
        return errors.BackendUnavailable(f"celery backend {self.name} (amqp): {text}"[:500])
