"""An app's Dramatiq actors, as the drain's Dramatiq backend reaches them.

Nothing here knows about the drain: the worker is plain Dramatiq. Run it with

    DRAMATIQ_BROKER_URL=redis://127.0.0.1:6379/0 dramatiq examples.dramatiq_actors --queues emails

and point a drain at the same broker:

    [backends.tasks]
    type = "dramatiq"
    url = "redis://127.0.0.1:6379/0"
    allowed_actors = ["send_welcome_email"]

A row staged with ``job_name = 'send_welcome_email'``, ``queue = 'emails'`` and ``backend =
'tasks'`` runs ``send_welcome_email`` once its transaction committed. The message id is the row's
``job_id``: delivery is at least once, so the actor makes its effect idempotent on it.
"""

from __future__ import annotations

import logging
import os

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage

log = logging.getLogger(__name__)

_url = os.environ.get("DRAMATIQ_BROKER_URL", "redis://127.0.0.1:6379/0")
broker: dramatiq.Broker = RabbitmqBroker(url=_url) if _url.startswith("amqp") else RedisBroker(url=_url)
broker.add_middleware(CurrentMessage())  # the message id (= the staged job_id) inside an actor
dramatiq.set_broker(broker)

_sent: set[str] = set()  # stands in for the app's own record of what it did, keyed by job id


@dramatiq.actor(queue_name="emails", max_retries=5)
def send_welcome_email(user_id: int, email: str) -> None:
    message = CurrentMessage.get_current_message()
    job_id = message.message_id if message is not None else None
    if job_id in _sent:  # forwarded twice (a crash between the broker's ack and the drain's commit)
        return
    log.info("welcome mail for user %s (job %s)", user_id, job_id)  # the app sends it here
    if job_id is not None:
        _sent.add(job_id)
