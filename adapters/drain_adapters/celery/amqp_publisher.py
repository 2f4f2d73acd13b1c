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

    basic.return ... basic.ack     -> RETRY, no attempt counted (unroutable: no queue of that
                                      name, which every job of that queue meets: the relay
                                      paces the queue); a queue the drain declared on this
                                      connection (deleted since) is declared again first
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

The connection, the probe, the confirms and the failure state are the AMQP link's
(``drain_adapters.amqp.link``, shared with the RabbitMQ backend), on py-amqp (``amqp_link``);
this module adds what is Celery's: the message on the wire and the queues ``send_task`` declares.
Errors never carry the URL or the password.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from drain import errors, models
from drain_adapters.amqp import confirms as amqp_confirms
from drain_adapters.amqp import link as amqp_link
from drain_adapters.amqp import names as amqp_names
from drain_adapters.celery import amqp_link as celery_amqp_link
from drain_adapters.celery import message as celery_message
from drain_adapters.celery import queues as celery_queues

LATE_DECLARATION = (
    "celery: not sent: its queue was not declared within half the publish timeout (too many new "
    "queues in one batch); sent with a later batch"
)
log = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # py-amqp writes integers as at most 64-bit signed
MAX_TABLE_DEPTH = 100
MAX_DECLARED_QUEUES = 10_000  # queue names remembered as declared per connection

# The public names of Celery on AMQP, wherever they live.
AmqpAddress = celery_amqp_link.AmqpAddress
FramedMessage = celery_amqp_link.FramedMessage
Wire = celery_amqp_link.Wire
Ticket = amqp_confirms.Ticket  # a submitted batch whose confirms are outstanding


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
        self.publish_timeout_s = publish_timeout_s
        self.link = celery_amqp_link.CeleryAmqpLink(
            name,
            addresses,
            publish_timeout_s=publish_timeout_s,
            connect_timeout_s=connect_timeout_s,
            on_unroutable=self._unroutable,
        )
        self._declarations = declarations
        self._generation = 0  # the link's connection the sets below are about
        self._declared: set[str] = set()  # queues declared (or found existing) on this connection
        self._undeclared: set[str] = set()  # queues not declared on this connection (refused, none)
        self._gone: set[str] = set()  # declared queues found deleted, to declare again
        self._declare_channel: Any = None
        self._warned: set[str] = set()  # queues whose refused declaration was logged

    def open(self) -> None:
        """Connect to the first node that answers and prove it takes publishes
        (``amqp_link.AmqpLink.open``); raise BackendUnavailable when none does. The batch right
        after shares its deadline (``drain.backend.deadline``)."""
        self.link.deadline.opening()
        self.link.open()

    def ping(self) -> None:
        """Raise BackendUnavailable unless the broker takes a publish now (reconnecting when
        needed): the connection answers and a probe is confirmed."""
        self.link.deadline.start()
        self.link.ping()

    def close(self) -> None:
        """Close politely (bounded), then drop the socket. Idempotent."""
        self.link.deadline.start()  # a call of its own: an earlier call's deadline does not cut it
        self.link.close()

    def submit(self, messages: Sequence[Wire], ticket: Ticket) -> Ticket:
        """Write the messages (mandatory) and return at once; ``collect`` waits for their confirms.

        Raises BackendUnavailable when there is no connection to publish on.
        """
        if ticket.deadline is None:
            ticket.deadline = self.link.deadline.start()
        if not messages:
            return ticket
        link = self.link
        link.ensure_ready()
        self._forget_if_new_connection()
        try:
            # At most half of what is left of the call (half the publish timeout, unless the call
            # opened the backend): a batch naming thousands of new queues (4-5 ms each on
            # loopback) outlived the session's fence; the queues not declared in time have their
            # jobs retried, uncounted, with a later batch.
            now = time.monotonic()
            declare_by = now + (ticket.deadline - now) / 2
            with link.translated():
                late = self._declare_queues({message.routing_key for message, _ in messages}, declare_by)
        except amqp_link.LinkDown as down:
            raise link.give_up(down) from None
        if link.blocked:  # the alarm began while declaring: write no batch into it
            raise link.give_up(amqp_link.LinkDown(amqp_link.BLOCKED))
        sendable: list[tuple[models.StagedJob, Wire]] = []
        for wired in messages:
            if wired[0].routing_key in late:
                ticket.results.append(models.PublishResult.retry(wired[0].job, LATE_DECLARATION))
            else:
                sendable.append((wired[0].job, wired))
        link.send(ticket, sendable)
        return ticket

    def collect(self, ticket: Ticket) -> list[models.PublishResult]:
        """Wait for the ticket's confirms until the publish timeout after its submission (what
        already arrived is read even past it); one result per job."""
        if ticket.deadline is not None:
            self.link.deadline.until(ticket.deadline)
        return self.link.collect(ticket)

    def _forget_if_new_connection(self) -> None:
        """What was declared on an earlier connection is not on this one."""
        if self._generation != self.link.generation:
            self._generation = self.link.generation
            self._declared.clear()
            self._undeclared.clear()
            self._gone.clear()
            self._declare_channel = None

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
            if outcome is celery_queues.Outcome.FORBIDDEN:  # a permission: the whole backend's
                raise amqp_link.LinkDown(f"declaring queue {name[:100]!r} was refused: {why}")
            if outcome is celery_queues.Outcome.REFUSED:
                self._undeclared.add(name)
                self._warn_refused(name, why)
            else:
                self._declared.add(name)
                self._gone.discard(name)
        return set()

    def _warn_refused(self, name: str, why: str) -> None:
        if name not in self._warned and len(self._warned) < MAX_DECLARED_QUEUES:
            self._warned.add(name)
            log.warning(
                "backend %s: could not declare queue %r (%s); its jobs wait "
                "while no queue of that name exists",
                self.name,
                name,
                why,
                extra={"event": "queue_not_declared", "backend": self.name, "queue": name},
            )

    def _declaring_channel(self) -> Any:
        """The channel declarations go on (not the one in confirm mode), opened when needed."""
        channel = self._declare_channel
        if channel is None or not channel.is_open:
            channel = self._declare_channel = self.link.new_channel()
        return channel

    def _unroutable(self, exchange: str, routing_key: str) -> bool:
        """A message came back unroutable: whether its queue is one declared on this connection
        (deleted since: declared again, and the job retried)."""
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
        return gone
