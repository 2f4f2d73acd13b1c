"""The actor a real ``dramatiq`` worker runs in the Dramatiq tests.

The broker is Dramatiq's own for the URL in ``DRAIN_TEST_DRAMATIQ_URL`` (RabbitMQ or Redis), the
actor's queue the one in ``DRAIN_TEST_DRAMATIQ_QUEUE``. Each run is recorded as one row of the
``deliveries`` table of the test's database (tests.support.tasks: ``DRAIN_TEST_DELIVERIES_DSN``),
with the message id Dramatiq gave the actor: the drain's job id. Duplicates are kept.
"""

from __future__ import annotations

import json
import os
from typing import Any

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage

from tests.support import tasks

URL_VARIABLE = "DRAIN_TEST_DRAMATIQ_URL"
QUEUE_VARIABLE = "DRAIN_TEST_DRAMATIQ_QUEUE"
ACTOR = "record"

_url = os.environ.get(URL_VARIABLE, "redis://127.0.0.1:6379/0")
broker: dramatiq.Broker = RabbitmqBroker(url=_url) if _url.startswith("amqp") else RedisBroker(url=_url)
broker.add_middleware(CurrentMessage())
dramatiq.set_broker(broker)


@dramatiq.actor(actor_name=ACTOR, queue_name=os.environ.get(QUEUE_VARIABLE, "default"), max_retries=0)
def record(*args: Any, **kwargs: Any) -> None:
    """Record this run with its message id."""
    message = CurrentMessage.get_current_message()
    assert message is not None
    tasks._connection().execute(
        "INSERT INTO deliveries (job_id, job_name, args, kwargs, worker) VALUES (%s, %s, %s, %s, %s)",
        (message.message_id, message.actor_name, json.dumps(args), json.dumps(kwargs), os.getpid()),
    )
