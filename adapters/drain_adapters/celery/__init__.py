"""The Celery backend (``type = "celery"``): each staged job becomes the task message ``send_task``
would send (``adapter``).

The units: ``adapter`` (settings and the adapter), ``message`` (Celery's own message builder),
``amqp_publisher``, ``amqp_link`` and ``queues`` (RabbitMQ: pipelined confirms on the AMQP link
over py-amqp, the queues ``send_task`` declares) and ``redis_publisher`` (kombu's Redis
layout). Shared with the other backends: ``drain_adapters.amqp`` and ``drain_adapters.redis``.
"""

from drain_adapters.celery.adapter import DEFAULT_URL, CeleryAdapter, CelerySettings

__all__ = ["DEFAULT_URL", "CeleryAdapter", "CelerySettings"]
