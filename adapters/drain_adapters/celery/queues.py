"""The queue ``send_task`` declares before it publishes to it, and declaring it with py-amqp.

``send_task(queue=name)`` publishes with ``declare=[app.amqp.queues[name]]``, and kombu declares
that entity once per connection before the first publish to it: the exchange, the queue and the
binding. With Celery's defaults (``task_create_missing_queues`` on) a name not configured is
``Queue(name, Exchange(name, "direct"), routing_key=name)``, durable, with ``x-queue-type`` when
``task_create_missing_queue_type`` is ``quorum``; the default queue (``celery``) follows
``task_default_queue_type``. :func:`of` asks the drain's own Celery app for that entity, so the
drain declares what ``send_task`` would; None when Celery would declare nothing.

:func:`declare` declares it on a channel of its own (a refusal closes that channel, never the
one in confirm mode carrying the batches). A queue or exchange that exists with other
arguments (a worker declared a quorum queue, say) answers PRECONDITION_FAILED: it exists, which
is all publishing needs (the messages go to the default exchange, routing key = the queue).
Any other refusal (no ``configure`` permission, a queue whose node is down) is REFUSED: the
publish decides, and a message that finds no queue is then its job's rejection.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import amqp.exceptions
import celery

from drain_adapters.amqp import names as amqp_names


class Outcome(enum.Enum):
    DECLARED = "declared"
    EXISTS = "exists"  # PRECONDITION_FAILED: declared elsewhere with other arguments
    REFUSED = "refused"
    FORBIDDEN = "forbidden"  # ACCESS_REFUSED: the drain's user may not declare it (the backend's)


@dataclasses.dataclass(frozen=True)
class Declaration:
    """What kombu's ``Queue.declare`` sends for one queue."""

    queue: str
    durable: bool
    exclusive: bool
    auto_delete: bool
    arguments: dict[str, Any] | None
    exchange: str
    exchange_type: str
    exchange_durable: bool
    exchange_auto_delete: bool
    exchange_arguments: dict[str, Any] | None
    routing_key: str
    binding_arguments: dict[str, Any] | None


def declarable(name: str) -> bool:
    """Whether RabbitMQ declares a queue of exactly this name for a client (``amqp_names``)."""
    return amqp_names.queue_name_problem(name) is None


def of(app: celery.Celery, name: str) -> Declaration | None:
    """The declaration ``send_task(queue=name)`` makes with ``app``'s settings, or None.

    None too for a name RabbitMQ would not declare as given: empty (the server would invent a
    name, a new queue on every try), reserved (``amq.``), longer than 255 bytes, or holding a
    NUL, a carriage return or a line feed (RabbitMQ strips the last two: the queue declared
    would have another name). Its messages then find no queue, and each is its job's rejection."""
    if not declarable(name):
        return None
    queues = app.amqp.queues
    entity = queues.get(name)  # a configured queue; dict.get never creates the missing one
    if entity is None:
        if not queues.create_missing:
            return None
        entity = queues.new_missing(name)  # as Celery makes it, without remembering it
    if entity.no_declare:
        return None
    exchange = entity.exchange
    return Declaration(
        queue=entity.name,
        durable=bool(entity.durable),
        exclusive=bool(entity.exclusive),
        auto_delete=bool(entity.auto_delete),
        arguments=entity.queue_arguments or None,
        exchange=exchange.name if exchange is not None and not exchange.no_declare else "",
        exchange_type=exchange.type if exchange is not None else "direct",
        exchange_durable=bool(exchange is not None and exchange.durable),
        exchange_auto_delete=bool(exchange is not None and exchange.auto_delete),
        exchange_arguments=(exchange.arguments or None) if exchange is not None else None,
        routing_key=entity.routing_key or entity.name,
        binding_arguments=entity.binding_arguments or None,
    )


def declare(channel: Callable[[], Any], declaration: Declaration) -> tuple[Outcome, str]:
    """Declare the exchange, the queue and the binding, each on ``channel()`` (a usable channel,
    a new one after a refusal closed the last). Returns the outcome and, when REFUSED, why.
    A lost connection raises (py-amqp's connection errors, OSError)."""
    d = declaration
    exchange_ok = bool(d.exchange)
    try:
        if d.exchange:
            try:
                channel().exchange_declare(
                    d.exchange,
                    d.exchange_type,
                    durable=d.exchange_durable,
                    auto_delete=d.exchange_auto_delete,
                    arguments=d.exchange_arguments,
                )
            except amqp.exceptions.PreconditionFailed:
                exchange_ok = False  # another type or arguments: the queue still matters
        try:
            channel().queue_declare(
                d.queue,
                durable=d.durable,
                exclusive=d.exclusive,
                auto_delete=d.auto_delete,
                arguments=d.arguments,
            )
        except amqp.exceptions.PreconditionFailed:
            return Outcome.EXISTS, ""
        if exchange_ok:
            channel().queue_bind(
                d.queue, d.exchange, routing_key=d.routing_key, arguments=d.binding_arguments
            )
    except amqp.exceptions.AccessRefused as exc:
        return Outcome.FORBIDDEN, f"{type(exc).__name__}: {exc.reply_code} {exc.reply_text}"
    except amqp.exceptions.ChannelError as exc:
        return Outcome.REFUSED, f"{type(exc).__name__}: {exc.reply_code} {exc.reply_text}"
    return Outcome.DECLARED, ""
