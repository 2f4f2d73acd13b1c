"""The RabbitMQ backend's link (``amqp.link``) on pika: one SelectConnection with one channel in
confirm mode, driven by hand on the caller's thread.

Why SelectConnection, driven by hand: waiting for each confirm (BlockingConnection with
``confirm_delivery``) is latency-bound at about 1.7k msg/s. Here the I/O loop runs only inside
``run_until`` (from ``open``, ``ping``, ``send``, ``collect`` and ``close``): there is no
background thread. Heartbeats are only serviced while the loop runs, so a connection idle for
more than half the heartbeat is replaced before it is used again. A batch's frames leave in a few
large sends (``pika_io``).

pika's exceptions are translated in ``translated`` (and in ``_write``, which tells the link's
failure from the message's own); its callbacks report to the link's failure state. Confirms and
returns go to the ``ConfirmTracker``.

A message returned NO_ROUTE is retried without counting an attempt: every job with that routing
key would meet it, so it is the queue's (or the binding's) fault, never the job's; the relay
paces that queue. With ``declare = true`` and one of the declared ``queues``, the topology is
declared again before the next batch.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pika
import pika.channel
import pika.exceptions
import pika.spec

from drain import errors
from drain_adapters.amqp import confirms as amqp_confirms
from drain_adapters.amqp import link as amqp_link
from drain_adapters.rabbitmq import messages as rabbitmq_messages
from drain_adapters.rabbitmq import pika_io
from drain_adapters.rabbitmq import settings as rabbitmq_settings

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0  # a polite close (Connection.Close / CloseOk)
DROP_TIMEOUT_S = 1.0  # pika noticing its own socket was shut down

# What ``basic_publish`` raises when the channel or connection cannot carry a message; anything
# else it raises concerns that one message.
LINK_ERRORS = (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError, OSError)


class PikaLink(amqp_link.AmqpLink[rabbitmq_messages.Message]):
    """The link's I/O on pika: connecting, the loop, writing and releasing the connection."""

    def __init__(
        self,
        name: str,
        settings: rabbitmq_settings.RabbitMQSettings,
        tracker: amqp_confirms.ConfirmTracker,
    ) -> None:
        super().__init__(
            name,
            tracker,
            [settings.node(index) for index in range(len(settings.urls))],
            label="rabbitmq",
            what=f"rabbitmq backend {name}",
            connect_timeout_s=settings.connect_timeout_s,
            publish_timeout_s=settings.publish_timeout_s,
            idle_limit_s=settings.heartbeat_s / 2 if settings.heartbeat_s else float("inf"),
        )
        self.settings = settings
        self.frame_max = pika.URLParameters(settings.urls[0]).frame_max  # the negotiated value once open
        self._connection: pika.SelectConnection | None = None
        self._io: pika_io.DrivenLoop | None = None
        self._running: pika_io.DrivenLoop | None = None  # the loop running now, if any
        self._channel: pika.channel.Channel | None = None
        self._ready = False
        self._declaring = 0
        self.lost_queues: set[str] = set()
        """Declared queues a message came back from unroutable: declared again before the next batch."""

    def describe(self, error: BaseException | str) -> str:
        return self.settings.describe(error)

    @contextlib.contextmanager
    def translated(self) -> Iterator[None]:
        """pika's exceptions, whatever their type, as LinkDown (without the URL)."""
        try:
            yield
        except amqp_link.LinkDown:
            raise
        except Exception as exc:  # noqa: BLE001 - pika raises many types; none may leak the URL
            raise amqp_link.LinkDown(self.describe(exc)) from None

    @property
    def connection_open(self) -> bool:
        connection = self._connection
        return connection is not None and bool(connection.is_open)

    @property
    def ready(self) -> bool:
        return self._ready

    # --- closing --------------------------------------------------------------------------------

    def _close_politely(self) -> None:
        connection = self._connection
        if connection is None:
            return
        try:
            connection.close()
            self.run_until(lambda: connection.is_closed, CLOSE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - closing a broken connection may fail
            self._debug("closing failed", exc)

    def _release(self) -> None:
        """Shut the socket down (no closing handshake) and release the I/O loop."""
        connection, self._connection = self._connection, None
        io, self._io = self._io, None
        self._channel = None
        self._ready = False
        if connection is None or io is None:
            return
        try:
            self._run(io, lambda: io.shut_down(lambda: connection.is_closed, DROP_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - a broken connection is being thrown away
            self._debug("teardown", exc)

    def _debug(self, what: str, exc: Exception) -> None:
        log.debug("backend %s: %s: %s", self.name, what, type(exc).__name__, extra={"backend": self.name})

    # --- writing and the loop -------------------------------------------------------------------

    def _measure(self, message: rabbitmq_messages.Message) -> tuple[int, int]:
        return len(message.body), message.header_frame_bytes

    def _write(self, message: rabbitmq_messages.Message) -> None:
        channel = self._channel
        if channel is None or not self._ready:
            raise amqp_link.LinkDown("ChannelWrongStateError: no channel in confirm mode")
        try:
            channel.basic_publish(
                self.settings.exchange, message.routing_key, message.body, message.properties, mandatory=True
            )
        except LINK_ERRORS as exc:
            raise amqp_link.LinkDown(self.describe(exc)) from None

    def _write_probe(self) -> None:
        channel = self._channel
        assert channel is not None
        with self.translated():
            self._begin_batch()  # its three frames in one send
            channel.basic_publish(
                "", amqp_link.PROBE_ROUTING_KEY, amqp_link.PROBE_BODY, pika.BasicProperties(delivery_mode=1)
            )
            self.tracker.probe_sent()
            if self._io is not None:
                self._io.hand_over()

    def _begin_batch(self) -> None:
        if self._io is not None:
            self._io.hold()

    def _flush(self) -> None:
        # The batch's frames, joined, then one pass of the I/O loop hands them to the socket, so
        # the broker works on them while the caller does something else; their confirms wait in
        # the socket.
        with self.translated():
            if self._io is not None:
                self._io.hand_over()
            self.run_until(lambda: False, 0.0)

    def _wait(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        with self.translated():
            self.run_until(predicate, timeout_s)

    def _read_more(self) -> bool:
        before = self.tracker.outstanding
        with self.translated():
            self.run_until(lambda: self.tracker.outstanding < before or not self._ready, 0.0)
        return self.tracker.outstanding < before

    def run_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Run the I/O loop until ``predicate()`` holds or ``timeout_s`` passed (0: one pass)."""
        io = self._io
        if io is not None:
            self._run(io, lambda: io.run_until(predicate, timeout_s))

    def _run(self, io: pika_io.DrivenLoop, run: Callable[[], None]) -> None:
        self._running = io
        try:
            run()
        finally:
            self._running = None
            self._last_io = time.monotonic()

    def _wake(self) -> None:
        if self._running is not None:
            self._running.wake()


class PikaSession(PikaLink):
    """PikaLink's connection and channel, opened and followed through pika's callbacks."""

    # --- connecting -----------------------------------------------------------------------------

    def _connect(self, index: int, timeout_s: float) -> str | None:
        parameters = pika.URLParameters(self.settings.urls[index])
        parameters.heartbeat = self.settings.heartbeat_s
        parameters.blocked_connection_timeout = self.settings.publish_timeout_s
        parameters.socket_timeout = timeout_s
        parameters.stack_timeout = timeout_s
        parameters.connection_attempts = 1
        try:
            self._io = pika_io.DrivenLoop()
            self._connection = pika.SelectConnection(
                parameters,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_connection_closed,
                custom_ioloop=self._io.services,
            )
            self.run_until(lambda: self._ready or self.failure is not None, timeout_s)
        except Exception as exc:  # noqa: BLE001 - pika raises many types; none may leak the URL
            self.fail(exc)
        if self._ready and self._connection is not None:
            self.frame_max = self._connection.params.frame_max
            return None
        failure = self.failure or "no connection within connect_timeout_s"
        self.drop()
        return failure

    def _reopen_channel(self) -> None:
        connection = self._connection
        if connection is None:
            raise amqp_link.LinkDown(self.failure or "no connection")
        with self.translated():
            connection.channel(on_open_callback=self._on_channel_open)
            self.run_until(lambda: self._ready or self.failure is not None, self.connect_timeout_s)
        if not self._ready:
            raise amqp_link.LinkDown(self.failure or "no channel within connect_timeout_s")

    # --- pika callbacks (run inside the loop) -------------------------------------------------

    def _on_connection_open(self, connection: pika.SelectConnection) -> None:
        connection.add_on_connection_blocked_callback(self._on_blocked)
        connection.add_on_connection_unblocked_callback(self._on_unblocked)
        self.channel_error = None
        connection.channel(on_open_callback=self._on_channel_open)

    def _on_channel_open(self, channel: pika.channel.Channel) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_confirm_mode)

    def _on_confirm_mode(self, _frame: Any) -> None:
        self.tracker.restart()
        self._ready = True
        self._wake()

    def _on_open_error(self, _connection: Any, error: BaseException | str) -> None:
        self.fail(error)
        self._wake()

    def _on_connection_closed(self, connection: Any, reason: BaseException) -> None:
        if connection is self._connection:
            self.fail(f"connection closed: {self.describe(reason)}")
            self._ready = False
        self._wake()

    def _on_channel_closed(self, channel: pika.channel.Channel, reason: BaseException) -> None:
        if channel is not self._channel:
            return
        self._channel = None
        self._ready = False
        if isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            self.channel_closed(self.describe(reason), reason.reply_code, str(reason.reply_text))
        else:
            self.channel_closed(self.describe(reason))
        self._wake()

    def _on_blocked(self, _connection: Any, _frame: Any) -> None:
        self.blocked_by_broker()
        self._wake()

    def _on_unblocked(self, _connection: Any, _frame: Any) -> None:
        self.unblocked_by_broker()

    def _on_confirm(self, frame: Any) -> None:
        if frame.channel_number != getattr(self._channel, "channel_number", None):
            return  # a late confirm of a channel already given up
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        self.tracker.confirmed(method.delivery_tag, multiple=method.multiple, acked=acked)
        self._wake()

    @abc.abstractmethod
    def _on_return(
        self, channel: Any, method: pika.spec.Basic.Return, properties: pika.BasicProperties, _body: bytes
    ) -> None:
        """A message came back unroutable."""


class RabbitMQLink(PikaSession):
    """The connection and confirm-mode channel the RabbitMQ adapter publishes on: PikaSession,
    with the topology ``declare = true`` asks for and what a returned message means."""

    def _prepare(self) -> None:
        if self.settings.declare or self.settings.exchange:
            self._declare()
        self.lost_queues.clear()

    def _after_ready(self) -> None:
        if self.lost_queues:
            self._declare_again()

    def _declare_again(self) -> None:
        """Declare the topology again after a declared queue was found gone (NO_ROUTE)."""
        log.warning(
            "backend %s: declared queue(s) %s returned messages as unroutable (deleted?); "
            "declaring them again",
            self.name,
            ", ".join(sorted(self.lost_queues)),
            extra={"event": "queue_redeclared", "backend": self.name},
        )
        try:
            self._declare()
        except errors.BackendUnavailable:
            self.drop()
            raise
        self.lost_queues.clear()

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
        queue_type = self.settings.queue_type
        arguments = {"x-queue-type": queue_type} if queue_type else None
        for queue in () if passive else self.settings.queues:
            self._declaring += 1
            channel.queue_declare(queue, durable=True, arguments=arguments, callback=done)
            if exchange:
                self._declaring += 1
                channel.queue_bind(queue, exchange, routing_key=queue, callback=done)
        self.run_until(
            lambda: self._declaring == 0 or not self._ready or self.failure is not None,
            self.connect_timeout_s,
        )
        if self._declaring:
            reason = self.failure or self.channel_error or "timed out"
            what = (
                f"the exchange {exchange!r} is missing or unusable"
                if passive
                else "declaring the topology failed"
            )
            raise self.unavailable(f"{what}: {reason}")

    def missing_queues(self, queues: Sequence[str]) -> list[str]:
        """One line for each of ``queues`` the broker does not have (a passive declare each: the
        broker closes the channel over a missing one, which is opened again for the next)."""
        found: list[str] = []
        for queue in queues:
            why = self._passive_declare(queue)
            if why is not None:
                found.append(f"queue {queue!r} is missing or unusable: {why}")
        return found

    def _passive_declare(self, queue: str) -> str | None:
        """None when the queue exists, else why not; raise BackendUnavailable."""
        self.ensure_ready()
        channel = self._channel
        assert channel is not None
        answered: list[object] = []

        def done(frame: Any) -> None:
            answered.append(frame)
            self._wake()

        channel.queue_declare(queue, passive=True, callback=done)
        self.run_until(
            lambda: bool(answered) or not self._ready or self.failure is not None, self.connect_timeout_s
        )
        return None if answered else (self.channel_error or self.failure or "no answer")

    def _on_return(
        self, channel: Any, method: pika.spec.Basic.Return, properties: pika.BasicProperties, _body: bytes
    ) -> None:
        if channel is not self._channel:
            return
        queue = method.routing_key
        settings = self.settings
        gone = settings.declare and queue in settings.queues and method.exchange == settings.exchange
        if gone:
            self.lost_queues.add(queue)
        self.tracker.returned(
            str(properties.message_id),
            f"unroutable: {method.reply_code} {method.reply_text} "
            f"(exchange {method.exchange!r}, routing key {queue!r})"
            + ("; a declared queue: declaring it again" if gone else ""),
            retry=True,  # no route: every job of that routing key meets it, the queue's fault
        )
