"""The Dramatiq backend (``type = "dramatiq"``): each staged job becomes the message
``actor.send()`` would write (``adapter``).

The units: ``settings`` (the config section), ``message`` (a row to Dramatiq's message, pure),
``rabbitmq_link`` (RabbitMQ: the RabbitMQ backend's pika link with the queues Dramatiq declares)
and ``redis_publisher`` (Redis: what Dramatiq's Redis broker writes, one script call per batch).
Shared with the other backends: ``drain_adapters.amqp``, ``drain_adapters.rabbitmq.link`` and
``drain_adapters.redis``.
"""

from drain_adapters.dramatiq.adapter import DramatiqAdapter
from drain_adapters.dramatiq.settings import DEFAULT_URL, DramatiqSettings

__all__ = ["DEFAULT_URL", "DramatiqAdapter", "DramatiqSettings"]
