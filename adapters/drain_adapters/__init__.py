"""Backends for drain, one package per broker (``rq``, ``rabbitmq``, ``celery``), each imported
only when configured; ``amqp`` and ``redis`` hold what two backends share."""
