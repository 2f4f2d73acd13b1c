"""Dramatiq messages onto RabbitMQ: the RabbitMQ backend's pika link (confirms, probe, failure
state) with the queues Dramatiq's broker declares.

``RabbitmqBroker.enqueue`` publishes ``message.encode()`` to the default exchange with the queue
as routing key, persistent (``delivery_mode`` 2), with ``priority`` = the ``broker_priority``
option — no other property. Before its first publish to a queue it declares three, durable:

    <queue>      x-dead-letter-exchange "", x-dead-letter-routing-key <queue>.XQ [, x-max-priority]
    <queue>.DQ   the same arguments (its delay queue; the drain never publishes there)
    <queue>.XQ   x-message-ttl = the dead message TTL (its dead letters)

The drain declares them the same way, once per queue and connection, on a channel of its own
(a refusal closes that channel, never the one in confirm mode). A batch stops declaring at half
the publish timeout: the jobs of the queues left wait for a later batch (RETRY, uncounted), so a
batch naming thousands of new queues cannot hold its transaction open. A queue that exists with other
arguments (PRECONDITION_FAILED: a worker's broker has another ``max_priority``) is used as it is,
never redeclared. A refusal that names the queue (NOT_FOUND: its home node is down;
RESOURCE_LOCKED; ACCESS_REFUSED: the drain's user may not configure that queue, as least privilege
over the app's queues has it) makes that queue's jobs wait (RETRY, uncounted, paced per queue)
while the other queues flow; a lost connection or no answer makes the backend unavailable: the
rows wait.

A message returned unroutable went to a queue deleted after it was declared: its job is RETRY
(a queue-wide cause, no attempt counted) and the queue is declared again before the next batch.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

import pika.channel
import pika.exceptions
import pika.spec

from drain_adapters.amqp import confirms as amqp_confirms
from drain_adapters.amqp import link as amqp_link
from drain_adapters.dramatiq import message as dramatiq_message
from drain_adapters.rabbitmq import link as rabbitmq_link
from drain_adapters.rabbitmq import messages as rabbitmq_messages
from drain_adapters.rabbitmq import settings as rabbitmq_settings

log = logging.getLogger(__name__)

MAX_DECLARED_QUEUES = 10_000  # queue names remembered as declared per connection
LATE_DECLARATION = (
    "dramatiq: not sent: its queue was not declared within half the publish timeout (too many new "
    "queues in one batch); sent with a later batch"
)
PERSISTENT = 2


def wire(message: dramatiq_message.DramatiqMessage) -> rabbitmq_messages.Message:
    """What ``RabbitmqBroker.enqueue`` hands to ``basic_publish`` for this message."""
    properties = pika.BasicProperties(delivery_mode=PERSISTENT, priority=message.priority)
    return rabbitmq_messages.Message(message.queue, message.body, properties)


def declarations(
    queue: str, max_priority: int | None, dead_message_ttl_ms: int
) -> list[tuple[str, dict[str, Any]]]:
    """The queues (name, arguments) Dramatiq's broker declares for ``queue``, in its order."""
    arguments: dict[str, Any] = {
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": queue + dramatiq_message.DEAD_LETTER_SUFFIX,
    }
    if max_priority:
        arguments["x-max-priority"] = max_priority
    return [
        (queue, arguments),
        (queue + dramatiq_message.DELAY_SUFFIX, dict(arguments)),
        (queue + dramatiq_message.DEAD_LETTER_SUFFIX, {"x-message-ttl": dead_message_ttl_ms}),
    ]


class DramatiqLink(rabbitmq_link.PikaSession):
    """The pika link, with Dramatiq's queues declared before the first publish to each."""

    def __init__(
        self,
        name: str,
        settings: rabbitmq_settings.RabbitMQSettings,
        *,
        max_priority: int | None,
        dead_message_ttl_ms: int,
    ) -> None:
        super().__init__(name, settings, amqp_confirms.ConfirmTracker("dramatiq"))
        self.label = "dramatiq"
        self.what = f"dramatiq backend {name} (amqp)"
        self._max_priority = max_priority
        self._dead_message_ttl_ms = dead_message_ttl_ms
        self._declared: set[str] = set()
        self._declared_on = -1  # the connection (generation) they were declared on
        self._declaring_channel: pika.channel.Channel | None = None
        self._declare_closed: Any = None  # why the declaring channel closed, once it did

    def declare(self, queues: Iterable[str], deadline: float) -> dict[str, str | None]:
        """Declare each queue not declared on this connection yet (see the module docstring),
        starting none after ``deadline`` (monotonic seconds). Returns, for each queue, None when
        it takes messages, or why its jobs wait (not reached in time, refused by the broker).
        Raise BackendUnavailable (the connection dropped) when the whole backend refuses."""
        if self._declared_on != self.generation:
            self._declared.clear()
            self._declaring_channel = None
            self._declared_on = self.generation
        outcome: dict[str, str | None] = {}
        for queue in queues:
            if queue in self._declared:
                outcome[queue] = None
                continue
            if time.monotonic() > deadline:
                outcome[queue] = LATE_DECLARATION
                continue
            refusal = None
            for name, arguments in declarations(queue, self._max_priority, self._dead_message_ttl_ms):
                refusal = self._declare_one(name, arguments)
                if refusal is not None:
                    break
            outcome[queue] = refusal
            if refusal is not None:
                log.warning(
                    "backend %s: queue %r not declared, its jobs wait: %s",
                    self.name,
                    queue[:100],
                    refusal,
                    extra={"event": "queue_not_declared", "backend": self.name},
                )
                continue
            if len(self._declared) >= MAX_DECLARED_QUEUES:
                self._declared.clear()
            self._declared.add(queue)
        return outcome

    def _declare_one(self, name: str, arguments: dict[str, Any]) -> str | None:
        """Declare one queue: None once it exists, or why the broker refused that queue (its jobs
        wait; a permission refused names the queue too). A lost connection or no answer raise
        BackendUnavailable."""
        done: list[bool] = []

        def declared(_frame: Any) -> None:
            done.append(True)
            self._wake()

        try:
            with self.translated():
                channel = self._channel_for_declaring()
                channel.queue_declare(name, durable=True, arguments=arguments, callback=declared)
                self.run_until(
                    lambda: bool(done) or self._declare_closed is not None or self.failure is not None,
                    self.connect_timeout_s,
                )
        except amqp_link.LinkDown as down:
            raise self.give_up(down) from None
        if done:
            return None
        closed = self._declare_closed
        self._declaring_channel = None
        code = closed.reply_code if isinstance(closed, pika.exceptions.ChannelClosedByBroker) else None
        if code == amqp_link.PRECONDITION_FAILED:
            log.debug("backend %s: queue %r exists with other arguments: used as it is", self.name, name)
            return None
        if code is not None and self.failure is None:
            # the queue's own state (its home node down, exclusive to another connection) or a
            # permission over that queue's name: the broker closed only the declaring channel
            return f"dramatiq: the broker refused to declare queue {name[:100]!r}: {self.describe(closed)}"
        reason = self.failure or (
            self.describe(closed) if closed is not None else "no answer within connect_timeout_s"
        )
        raise self.give_up(amqp_link.LinkDown(f"declaring queue {name[:100]!r} failed: {reason}"))

    def _channel_for_declaring(self) -> pika.channel.Channel:
        channel = self._declaring_channel
        if channel is not None and channel.is_open:
            return channel
        connection = self._connection
        if connection is None:
            raise amqp_link.LinkDown(self.failure or "no connection")
        opened: list[pika.channel.Channel] = []

        def on_open(channel: pika.channel.Channel) -> None:
            opened.append(channel)
            self._wake()

        connection.channel(on_open_callback=on_open)
        self.run_until(lambda: bool(opened) or self.failure is not None, self.connect_timeout_s)
        if not opened:
            raise amqp_link.LinkDown(self.failure or "no channel within connect_timeout_s")
        channel = opened[0]
        self._declare_closed = None
        channel.add_on_close_callback(self._on_declaring_closed)
        self._declaring_channel = channel
        return channel

    def _on_declaring_closed(self, channel: pika.channel.Channel, reason: BaseException) -> None:
        if channel is self._declaring_channel:
            self._declare_closed = reason
            self._wake()

    def _on_return(
        self, channel: Any, method: pika.spec.Basic.Return, properties: pika.BasicProperties, body: bytes
    ) -> None:
        if channel is not self._channel:
            return
        queue = method.routing_key
        self._declared.discard(queue)
        try:
            message_id = str(json.loads(body)["message_id"])
        except (ValueError, TypeError, KeyError):
            return  # not one of ours: the probe is never mandatory
        self.tracker.returned(
            message_id,
            f"unroutable: {method.reply_code} {method.reply_text} (queue {queue[:100]!r} is gone; "
            "declaring it again)",
            retry=True,
        )
