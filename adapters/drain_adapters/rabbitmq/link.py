"""One pika SelectConnection with one channel in confirm mode, driven by hand on the caller's thread.

Why SelectConnection, driven by hand: waiting for each confirm (BlockingConnection with
``confirm_delivery``) is latency-bound at about 1.7k msg/s. Here the I/O loop runs only inside
``run_until`` (called from ``open``, ``ping``, ``submit``, ``collect`` and ``close`` of the
adapter): there is no background thread. Heartbeats are only serviced while the loop runs, so a
connection idle for more than half the heartbeat is replaced before it is used again.

Confirms and returns go to the ``ConfirmTracker``; the link only says whether it can publish:
``failure`` (the connection is gone or failed), ``blocked`` (a memory or disk alarm) and
``channel_error`` (the broker closed the channel). Dropping a connection (``teardown``) first
abandons what the tracker holds, then shuts the socket down without the closing handshake (a
blocked or hung broker would never answer it): unconfirmed jobs stay unconfirmed. The socket is
found through the I/O loop, which records the descriptors pika asks it to watch.

A new connection is proven before a batch is risked on it (``prove``): one tiny probe message,
not mandatory, to the default exchange with a routing key no queue can have (``amq.`` names are
the broker's), confirmed within what is left of connect_timeout_s (PROBE_MIN_S at least). A
broker under a memory or disk alarm stops reading a connection at its first publish and answers
``connection.blocked``: only the probe is held (and dropped as unroutable once the alarm clears),
never a batch, so retrying through an alarm does not pile up copies of the batch in the broker's
buffers. A probe the broker answers by closing the channel (a user without write access to the
default exchange) was read too: it proves the same.

With ``declare = true``, a message returned NO_ROUTE for one of the declared ``queues`` means the
queue (or its binding) is gone: the job is retried without counting an attempt, and the topology
is declared again before the next batch. Any other unroutable message stays its job's rejection.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import pika
import pika.adapters.select_connection
import pika.channel
import pika.exceptions
import pika.spec

from drain import errors
from drain_adapters.amqp import confirms as amqp_confirms
from drain_adapters.amqp import nodes as amqp_nodes
from drain_adapters.rabbitmq import messages as rabbitmq_messages
from drain_adapters.rabbitmq import settings as rabbitmq_settings

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0  # a polite close (Connection.Close / CloseOk)
DROP_TIMEOUT_S = 1.0  # pika noticing its own socket was shut down
PRECONDITION_FAILED = 406
PROBE_ROUTING_KEY = "amq.drain.probe"  # on the default exchange: "amq." queue names are reserved
PROBE_BODY = b"drain probe"  # not empty: a blocked broker stops between its header and body
PROBE_MIN_S = 1.0  # the probe's wait when connecting took (nearly) all of connect_timeout_s

# What ``basic_publish`` raises when the channel or connection cannot carry a message; anything
# else it raises concerns that one message.
LINK_ERRORS = (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError, OSError)


class WatchingIOLoop(pika.adapters.select_connection.IOLoop):  # type: ignore[misc]
    """pika's select-based I/O loop, remembering which descriptors it watches (the socket)."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: set[int] = set()

    def add_handler(self, fd: int, handler: Callable[[int, int], None], events: int) -> None:
        super().add_handler(fd, handler, events)
        self.watched.add(fd)

    def remove_handler(self, fd: int) -> None:
        self.watched.discard(fd)
        super().remove_handler(fd)


class BrokerLink:
    """The connection and confirm-mode channel the adapter publishes on (see the module docstring)."""

    def __init__(
        self,
        name: str,
        settings: rabbitmq_settings.RabbitMQSettings,
        tracker: amqp_confirms.ConfirmTracker,
    ) -> None:
        self.name = name
        self.settings = settings
        self.tracker = tracker
        self.failure: str | None = None
        self.blocked = False
        self.channel_error: str | None = None
        self.broker_max_bytes: int | None = None
        """The broker's max_message_size, once it refused a message over it on this connection."""
        self.frame_max = pika.URLParameters(settings.urls[0]).frame_max  # the negotiated value once open
        self.nodes = amqp_nodes.NodeRotation(len(settings.urls))
        self._node: int | None = None  # the node last connected to
        self._connection: pika.SelectConnection | None = None
        self._loop: WatchingIOLoop | None = None
        self._channel: pika.channel.Channel | None = None
        self._ready = False
        self._last_io = 0.0
        self._predicate: Callable[[], bool] | None = None
        self._running: WatchingIOLoop | None = None  # the loop inside ``_run_loop``, if any
        self._declaring = 0
        self.lost_queues: set[str] = set()
        """Declared queues a message came back from unroutable: declared again before the next batch."""

    # --- life ---------------------------------------------------------------------------------

    def open(self) -> None:
        """Connect to the first node that answers (the nodes share connect_timeout_s, see
        ``amqp_nodes``), open a channel in confirm mode and declare the topology if asked;
        raise BackendUnavailable (nothing left open) when that fails."""
        if self.usable:
            self.close()
        else:
            self.teardown()  # a failed or blocked connection would not answer a polite close
        failures: list[str] = []
        started = time.monotonic()
        for index, left_s in self.nodes.attempts(self.settings.connect_timeout_s):
            failure = self._connect(index, left_s)
            if failure is None:
                self._connected(index)
                break
            self.nodes.failed(index)
            failures.append(f"{self.settings.node(index)}: {failure}" if self.clustered else failure)
        else:
            raise self.unavailable("; ".join(failures) or "no node within connect_timeout_s")
        try:
            assert self._connection is not None
            self.frame_max = self._connection.params.frame_max
            if self.settings.declare or self.settings.exchange:
                self._declare()
            self.lost_queues.clear()
            self.prove(max(PROBE_MIN_S, started + self.settings.connect_timeout_s - time.monotonic()))
        except errors.BackendUnavailable:
            self.teardown()
            raise
        except Exception as exc:  # noqa: BLE001 - pika raises many types; none may leak the URL
            self.teardown()
            raise self.unavailable(self.settings.describe(exc)) from None

    @property
    def clustered(self) -> bool:
        return self.nodes.count > 1

    def _connect(self, index: int, timeout_s: float) -> str | None:
        """Connect to node ``index`` and open the channel within ``timeout_s``; None, or why
        not (nothing left open then)."""
        self.failure = None
        self.blocked = False
        self.broker_max_bytes = None
        parameters = pika.URLParameters(self.settings.urls[index])
        parameters.heartbeat = self.settings.heartbeat_s
        parameters.blocked_connection_timeout = self.settings.publish_timeout_s
        parameters.socket_timeout = timeout_s
        parameters.stack_timeout = timeout_s
        parameters.connection_attempts = 1
        try:
            self._loop = WatchingIOLoop()
            self._connection = pika.SelectConnection(
                parameters,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_connection_closed,
                custom_ioloop=self._loop,
            )
            self.run_until(lambda: self._ready or self.failure is not None, timeout_s)
        except Exception as exc:  # noqa: BLE001 - pika raises many types; none may leak the URL
            self.failure = self.failure or self.settings.describe(exc)
        if self._ready:
            return None
        failure = self.failure or "no connection within connect_timeout_s"
        self.teardown()
        return failure

    def _connected(self, index: int) -> None:
        """Remember the node; say so when the drain moved to another node of a cluster."""
        moved = self.clustered and index != self._node
        self._node = index
        self.nodes.connected(index)
        if moved:
            log.info(
                "backend %s: connected to %s (node %d of %d)",
                self.name,
                self.settings.node(index),
                index + 1,
                self.nodes.count,
                extra={"event": "broker_node", "backend": self.name, "node": self.settings.node(index)},
            )

    def ensure_ready(self) -> None:
        """Make sure there is a usable channel to publish on: reconnect after a failure, an
        alarm or an idle period, reopen a channel the broker closed, declare again the queues
        found gone. What the broker sent meanwhile is read first (a ``connection.blocked``)."""
        idle_limit = self.settings.heartbeat_s / 2 if self.settings.heartbeat_s else float("inf")
        connection = self._connection
        idle = time.monotonic() - self._last_io > idle_limit
        if connection is not None and self.usable and not idle:
            self.run_until(lambda: False, 0.0)
        if connection is None or not self.usable:
            self.open()
        elif idle:
            log.debug(
                "backend %s: reconnecting after an idle period", self.name, extra={"backend": self.name}
            )
            self.open()
        elif not self._ready:
            self._reopen_channel()
        if self.lost_queues:
            self._declare_again()

    def _reopen_channel(self) -> None:
        """Open a new channel in confirm mode on the live connection (the broker closed ours)."""
        connection = self._connection
        assert connection is not None
        self.channel_error = None
        connection.channel(on_open_callback=self._on_channel_open)
        self.run_until(lambda: self._ready or self.failure is not None, self.settings.connect_timeout_s)
        if not self._ready:
            self.teardown()
            raise self.unavailable(self.failure or "no channel within connect_timeout_s")

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
            self.teardown()
            raise
        self.lost_queues.clear()

    def prove(self, timeout_s: float | None = None) -> None:
        """Publish the probe and wait for its confirm, at most ``timeout_s`` (connect_timeout_s by
        default; see the module docstring); raise BackendUnavailable, the connection torn down,
        when the broker blocks or stays silent."""
        timeout_s = self.settings.connect_timeout_s if timeout_s is None else timeout_s
        if self.usable and not self._ready:
            self._reopen_channel()
        channel = self._channel
        if channel is None or not self._ready:
            reason = self.failure or "no channel to publish on"
            self.teardown()
            raise self.unavailable(reason)
        tracker = self.tracker
        try:
            channel.basic_publish("", PROBE_ROUTING_KEY, PROBE_BODY, pika.BasicProperties(delivery_mode=1))
            tracker.probe_sent()
            self.coalesce_writes()
            self.run_until(
                lambda: tracker.probe is not None or not self.usable or not self._ready,
                timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - pika raises many types; none may leak the URL
            self.failure = self.failure or self.settings.describe(exc)
        if self.usable and (tracker.probe or (not self._ready and self.channel_error is not None)):
            return  # confirmed, or answered with a channel close: the broker reads our publishes
        reason = (
            self.failure
            or ("the broker blocks publishing (resource alarm)" if self.blocked else None)
            or ("the broker nacked a probe" if tracker.probe is False else None)
            or f"no confirm of a probe within {timeout_s:.1f}s"
        )
        self.teardown()
        raise self.unavailable(reason)

    @property
    def usable(self) -> bool:
        """The connection is open, not failed and not blocked (the channel may need reopening)."""
        connection = self._connection
        return connection is not None and connection.is_open and self.failure is None and not self.blocked

    @property
    def ready(self) -> bool:
        """A channel in confirm mode is open: ``publish`` may be called."""
        return self._ready

    def close(self) -> None:
        """Close the connection politely (bounded by CLOSE_TIMEOUT_S), then release it. Idempotent."""
        connection = self._connection
        if connection is not None and connection.is_open:
            try:
                connection.close()
                self.run_until(lambda: connection.is_closed, CLOSE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - closing a broken connection may fail
                log.debug(
                    "backend %s: closing failed: %s",
                    self.name,
                    type(exc).__name__,
                    extra={"backend": self.name},
                )
        self.teardown()

    def teardown(self) -> None:
        """Give up the connection at once: abandon every unconfirmed job, shut the socket down
        (no closing handshake) and release the I/O loop. A connection given up because it
        failed sends the next ``open`` to the next node first."""
        self.tracker.abandon(self.failure or "the connection was closed", retry=False)
        if self.failure is not None or self.blocked:
            self.nodes.lost()
        else:
            self.nodes.closed()
        connection, self._connection = self._connection, None
        loop, self._loop = self._loop, None
        self._channel = None
        self._ready = False
        if connection is None or loop is None:
            return
        try:
            if not connection.is_closed:
                for fd in list(loop.watched):
                    shut_down(fd)
                self._run_loop(loop, lambda: connection.is_closed, DROP_TIMEOUT_S)
            loop.close()
        except Exception as exc:  # noqa: BLE001 - a broken connection is being thrown away
            log.debug("backend %s: teardown: %s", self.name, type(exc).__name__, extra={"backend": self.name})

    # --- publishing and the loop --------------------------------------------------------------

    def publish(self, message: rabbitmq_messages.Message) -> None:
        """Write one message (mandatory) on the channel; the caller records it as sent."""
        channel = self._channel
        if channel is None or not self._ready:
            raise pika.exceptions.ChannelWrongStateError("no channel in confirm mode")
        channel.basic_publish(
            self.settings.exchange, message.routing_key, message.body, message.properties, mandatory=True
        )

    def coalesce_writes(self) -> None:
        """Join the frames waiting for the socket into one chunk, so a batch leaves in a few large
        sends. pika buffers every frame as its own chunk (a message is three frames: method,
        header, body) and sends each with its own ``send()``; with TCP_NODELAY that is a system
        call and a TCP segment per frame, which on a small machine cost more CPU than the rest
        of publishing. Best effort on pika 1.x's transport: skipped where it looks different."""
        transport = getattr(self._connection, "_transport", None)
        buffers = getattr(transport, "_tx_buffers", None)
        if not isinstance(buffers, collections.deque) or len(buffers) < 2:
            return
        if not all(isinstance(chunk, bytes) for chunk in buffers):
            return
        joined = b"".join(buffers)  # same bytes, same order: the buffered byte count is unchanged
        buffers.clear()
        buffers.append(joined)

    def run_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Run the I/O loop until ``predicate()`` holds or ``timeout_s`` passed (0: one pass)."""
        if self._loop is not None:
            self._run_loop(self._loop, predicate, timeout_s)

    def run_once_progressed(self, predicate: Callable[[], bool]) -> bool:
        """One pass of the I/O loop without waiting; say whether it settled a confirm."""
        before = self.tracker.outstanding
        self.run_until(predicate, 0.0)
        return self.tracker.outstanding < before

    def _run_loop(self, loop: WatchingIOLoop, predicate: Callable[[], bool], timeout_s: float) -> None:
        if predicate():
            return
        self._predicate, self._running = predicate, loop
        timer = loop.call_later(timeout_s, loop.stop)
        try:
            loop.start()
        finally:
            self._predicate, self._running = None, None
            loop.remove_timeout(timer)
            self._last_io = time.monotonic()

    def _wake(self) -> None:
        if self._predicate is not None and self._running is not None and self._predicate():
            self._running.stop()

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
            self.settings.connect_timeout_s,
        )
        if self._declaring:
            reason = self.failure or self.channel_error or "timed out"
            what = (
                f"the exchange {exchange!r} is missing or unusable"
                if passive
                else "declaring the topology failed"
            )
            raise self.unavailable(f"{what}: {reason}")

    def unavailable(self, reason: str) -> errors.BackendUnavailable:
        return errors.BackendUnavailable(f"rabbitmq backend {self.name}: {self.settings.describe(reason)}")

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
        self.failure = self.settings.describe(error)
        self._wake()

    def _on_connection_closed(self, connection: Any, reason: BaseException) -> None:
        if connection is self._connection:
            self.failure = f"connection closed: {self.settings.describe(reason)}"
            self._ready = False
        self._wake()

    def _on_channel_closed(self, channel: pika.channel.Channel, reason: BaseException) -> None:
        if channel is not self._channel:
            return
        self._channel = None
        self._ready = False
        self.channel_error = self.settings.describe(reason)
        if isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            limit = amqp_confirms.oversize_limit(str(reason.reply_text))
            if reason.reply_code == PRECONDITION_FAILED and limit is not None:
                # One message over the broker's max_message_size: that job is refused (an
                # attempt counted), its neighbours retried, and the limit kept for this
                # connection so the next oversized message is refused before it is sent.
                self.broker_max_bytes = limit
                self.tracker.refuse_larger(limit, f"refused by the broker: {reason.reply_text}")
            else:
                # 404: the exchange is gone, which fails every job alike: the backend is
                # unavailable (paused, drain_backend_up 0) rather than each job retried forever.
                self.tracker.abandon(f"channel closed: {self.channel_error}", retry=reason.reply_code != 404)
        self._wake()

    def _on_blocked(self, _connection: Any, _frame: Any) -> None:
        log.warning(
            "backend %s: the broker blocks publishing (memory or disk alarm)",
            self.name,
            extra={"event": "broker_blocked", "backend": self.name},
        )
        self.blocked = True
        self._wake()

    def _on_unblocked(self, _connection: Any, _frame: Any) -> None:
        self.blocked = False

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
            retry=gone,
        )

    def _on_confirm(self, frame: Any) -> None:
        if frame.channel_number != getattr(self._channel, "channel_number", None):
            return  # a late confirm of a channel already given up
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        self.tracker.confirmed(method.delivery_tag, multiple=method.multiple, acked=acked)
        self._wake()


def shut_down(fd: int) -> None:
    """Shut down the socket behind ``fd`` (both directions) without closing pika's descriptor:
    its owner sees end-of-stream and closes it itself."""
    with contextlib.suppress(OSError):
        duplicate = socket.socket(fileno=os.dup(fd))
        try:
            duplicate.shutdown(socket.SHUT_RDWR)
        finally:
            duplicate.close()
