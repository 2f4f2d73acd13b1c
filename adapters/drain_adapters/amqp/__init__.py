"""What the two AMQP users (the RabbitMQ backend, Celery on AMQP) share: the names and headers a
broker takes (``names``), which cluster node to try (``nodes``) and delivery tags to outcomes
(``confirms``), and the link: one connection with one channel in confirm mode, its lifecycle and
its failure state, whatever the client library (``link``; pika's side in ``rabbitmq.link``,
py-amqp's in ``celery.amqp_link``), and a batch's ``basic.publish`` frames built to be written
together (``frames``, Celery on AMQP's). No client library is imported here."""
