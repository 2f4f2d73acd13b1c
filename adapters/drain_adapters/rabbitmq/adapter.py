"""The RabbitMQ backend: each staged job becomes one persistent AMQP message, confirmed by the broker.

What a consumer receives (SPEC §7) is in ``rabbitmq_messages``: a message published to
``exchange`` (the default exchange ``""`` unless configured) with routing key = the row's
``queue`` (or its ordering key, with ``routing_key = "ordering_key"``), ``message_id`` = job id,
``type`` = job name and a JSON body; a keyed job's key in the header ``x-ordering-key``. Row options:
``priority`` (0-255), ``expiration`` (milliseconds) and ``headers`` (an object); any other option,
and anything AMQP or RabbitMQ would refuse, makes that job REJECTED before it is sent.

The units: ``rabbitmq_settings`` (the config section), ``rabbitmq_messages`` (a row to a message,
pure) and ``rabbitmq_link`` (the pika connection, driven by hand: the AMQP link of
``drain_adapters.amqp.link``, which owns connecting, reconnecting, the probe, confirms and the
failure state, shared with Celery on AMQP). This class only orders them:

``submit`` builds the batch's messages (``drain.backend.build_each``: a row that cannot be a
message is that row's rejection), writes them on one channel in confirm mode, runs one pass of the
I/O loop to hand the frames to the socket, and returns a ticket; ``collect`` runs the loop until
every delivery tag of that ticket is settled or the publish timeout passes. The relay keeps
several tickets outstanding (``pipeline_depth``) so the broker persists one batch while the relay
reads the next. ``publish_batch`` is ``collect(submit(...))``. With a named exchange, ``open``
checks that it exists (a passive declare) unless ``declare = true`` creates it.

A message returned unroutable is RETRY (no attempt counted): every job of that routing key
meets it, so it is the queue's or the binding's fault; the relay paces that queue. With
``declare = true`` and a routing key of ``queues``, the topology is declared again before the
next batch. Each new connection proves with a probe that the broker takes
publishes before a batch is risked on it (``amqp_link``).

When the channel or connection fails::

    channel closed over a message's size (406)          -> REJECTED for the jobs over the broker's
                                                           max_message_size, RETRY for the others
    channel closed by the broker (406, ...)             -> RETRY for the unconfirmed jobs
    channel closed with 404 (the exchange is gone)      -> as a lost connection, below
    channel closed with 403 (a permission refused)      -> as a lost connection, below
    connection lost / blocked (alarm) / no confirm within publish_timeout_s:
        the connection is torn down; nothing confirmed yet -> BackendUnavailable (rows untouched)
                                     some confirmed       -> PUBLISHED for those, RETRY the rest

A blocked connection (memory or disk alarm) fails the batch at once rather than holding the
database transaction open; the relay pauses the backend and retries with backoff. The adapter
never logs a message body, and no URL or password appears in its errors.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from drain import backend, models
from drain_adapters.amqp import confirms as amqp_confirms
from drain_adapters.rabbitmq import link as rabbitmq_link
from drain_adapters.rabbitmq import messages as rabbitmq_messages
from drain_adapters.rabbitmq import settings as rabbitmq_settings

# The public names of the backend, wherever they live.
DEFAULT_URL = rabbitmq_settings.DEFAULT_URL
RabbitMQSettings = rabbitmq_settings.RabbitMQSettings
Ticket = amqp_confirms.Ticket
BACKEND_NAME = "rabbitmq"  # prefixes the reason of a job refused before sending


class RabbitMQAdapter:
    """Publish staged jobs to RabbitMQ with publisher confirms; see the module docstring."""

    def __init__(self, name: str, settings: RabbitMQSettings) -> None:
        self.name = name
        self.settings = settings
        self._link = rabbitmq_link.RabbitMQLink(name, settings, amqp_confirms.ConfirmTracker())

    def __repr__(self) -> str:
        return f"RabbitMQAdapter({self.name!r}, {self.settings!r})"

    @classmethod
    def from_options(
        cls, name: str, options_: Mapping[str, Any], *, publish_timeout_s: float
    ) -> RabbitMQAdapter:
        return cls(name, RabbitMQSettings.parse(name, options_, publish_timeout_s))

    def open(self) -> None:
        """Connect, open a channel in confirm mode, declare the topology if asked, and prove
        the broker takes a publish (a probe confirmed, see ``amqp_link``). The batch right after
        shares its deadline (``drain.backend.deadline``)."""
        self._link.deadline.opening()
        self._link.open()

    def ping(self) -> None:
        """Raise BackendUnavailable unless the broker takes a publish now: the connection is
        usable (reconnecting if it dropped) and a probe is confirmed (``AmqpLink.ping``)."""
        self._link.deadline.start()
        self._link.ping()

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        return self.collect(self.submit(jobs))

    def submit(self, jobs: Sequence[models.StagedJob], /) -> Ticket:
        """Write the batch to the broker and return at once; ``collect`` waits for its confirms.

        Jobs refused before publishing are settled in the ticket already, as is a job whose
        ``basic_publish`` raised for a reason of its own (the net behind ``rabbitmq_messages``).
        Several tickets may be outstanding on the channel; each is collected on its own. Raises
        BackendUnavailable when there is no connection to publish on.
        """
        link = self._link
        build = functools.partial(
            rabbitmq_messages.build,
            max_body_bytes=self.settings.max_message_bytes,
            frame_max=link.frame_max,
            exchange=self.settings.exchange,
            by_key=self.settings.by_key,
        )
        messages, refused = backend.build_each(jobs, build, BACKEND_NAME)
        ticket = Ticket(results=refused, deadline=link.deadline.start())
        if not messages:
            return ticket
        link.ensure_ready()
        link.send(ticket, messages)
        return ticket

    def collect(self, ticket: Ticket, /) -> list[models.PublishResult]:
        """Wait for the ticket's confirms until publish_timeout_s after its submission; one
        result per job.

        Raises BackendUnavailable when nothing of it was confirmed and the broker failed.
        """
        if ticket.deadline is not None:
            self._link.deadline.until(ticket.deadline)
        return self._link.collect(ticket)

    def problems(self) -> list[str]:
        """What the drain needs on the broker and does not find (``drain check``): each of
        ``queues`` (a passive declare; with ``declare = true`` the drain declares them itself).
        The named exchange was checked by ``open``. A binding cannot be checked without
        publishing through it."""
        if self.settings.declare:
            return []
        return self._link.missing_queues(self.settings.queues)

    def close(self) -> None:
        """Close the connection politely (bounded), then release it. Idempotent."""
        self._link.close()


__all__ = ["DEFAULT_URL", "RabbitMQAdapter", "RabbitMQSettings", "Ticket"]
