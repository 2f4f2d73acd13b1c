"""The RabbitMQ backend (``type = "rabbitmq"``): each staged job becomes one persistent AMQP
message, confirmed by the broker (``adapter``).

The units: ``settings`` (the config section), ``messages`` (a row to a message, pure), ``link``
and ``pika_io`` (the AMQP link on pika) and ``adapter`` (orders them). The link's lifecycle and
failure state, the confirms and the names AMQP accepts are ``drain_adapters.amqp``, shared with
Celery on AMQP.
"""

from drain_adapters.rabbitmq.adapter import DEFAULT_URL, RabbitMQAdapter, RabbitMQSettings, Ticket

__all__ = ["DEFAULT_URL", "RabbitMQAdapter", "RabbitMQSettings", "Ticket"]
