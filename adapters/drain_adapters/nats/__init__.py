"""The NATS JetStream backend (``type = "nats"``): each staged job becomes one message on a
subject a stream covers, with ``Nats-Msg-Id`` = ``<job id>:<row id>``, acknowledged by a PubAck (``adapter``).

The units: ``settings`` (the config section), ``messages`` (a row to a message, pure),
``protocol`` (one NATS connection on a socket, on the caller's thread), ``link`` (which server,
the JetStream API, dropping a failed connection) and ``adapter`` (batches, their
acknowledgements and what each answer means).
"""

from drain_adapters.nats.adapter import NatsAdapter, Ticket
from drain_adapters.nats.settings import DEFAULT_URL, NatsSettings

__all__ = ["DEFAULT_URL", "NatsAdapter", "NatsSettings", "Ticket"]
