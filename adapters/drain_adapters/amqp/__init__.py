"""What the two AMQP users (the RabbitMQ backend, Celery on AMQP) share: the names and headers a
broker takes (``names``), which cluster node to try (``nodes``) and delivery tags to outcomes
(``confirms``). No client library is imported here."""
