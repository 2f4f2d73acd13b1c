"""The Dramatiq backend: each staged job becomes the message ``actor.send()`` would write.

A row is a message for the actor named by its ``job_name`` on the queue named by its ``queue``,
its job id the ``message_id`` (``dramatiq_message``), so an unmodified ``dramatiq`` worker runs
it and cannot tell it from ``send()``'s. A delayed job waits in Postgres until its ``run_at``:
Dramatiq's delay queues are never used. It is published with acknowledgements:

- RabbitMQ (``amqp://``, ``amqps://``, a list of a cluster's nodes): batches with many publisher
  confirms outstanding on the RabbitMQ backend's pika link, each queue declared first as
  Dramatiq's broker declares it (``dramatiq_rabbitmq``);
- Redis (``redis://``, ``rediss://``, or Sentinel): one script call per batch writing what
  Dramatiq's broker writes, each job id at most once while its message is held
  (``dramatiq_redis``); the reply is the acknowledgement.

``allowed_actors`` lists the actor names a row may name, matched exactly; without it ``drain
check`` and ``drain run`` warn once. Outages (a connection refused or lost, READONLY, OOM, a
blocked connection, an ACL) raise BackendUnavailable and the rows wait; a queue-wide cause
(a queue's key of another type, a queue deleted under the drain) is RETRY.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from drain import backend, models
from drain_adapters.amqp import confirms as amqp_confirms
from drain_adapters.dramatiq import message as dramatiq_message
from drain_adapters.dramatiq import rabbitmq_link as dramatiq_rabbitmq
from drain_adapters.dramatiq import redis_publisher as dramatiq_redis
from drain_adapters.dramatiq import settings as dramatiq_settings

log = logging.getLogger(__name__)

BACKEND_NAME = "dramatiq"  # prefixes the reason of a job refused before sending


class DramatiqAdapter:
    """Forward staged jobs as Dramatiq messages; see the module docstring."""

    def __init__(self, name: str, settings: dramatiq_settings.DramatiqSettings) -> None:
        self.name = name
        self.settings = settings
        self._amqp: dramatiq_rabbitmq.DramatiqLink | None = None
        self._redis: dramatiq_redis.RedisPublisher | None = None
        if settings.amqp is not None:
            self._amqp = dramatiq_rabbitmq.DramatiqLink(
                name,
                settings.amqp,
                max_priority=settings.max_priority,
                dead_message_ttl_ms=settings.dead_message_ttl_ms,
            )
        else:
            assert settings.redis is not None
            self._redis = dramatiq_redis.RedisPublisher(
                name,
                settings.redis,
                namespace=settings.namespace,
                timeout_s=settings.publish_timeout_s,
                wait=settings.wait,
            )
        if settings.allowed_actors is None:
            log.warning(
                "backend %s: no allowed_actors; any row can make the Dramatiq workers run any of "
                'their actors (set allowed_actors = ["send_email", ...])',
                name,
                extra={"event": "no_allowed_jobs", "backend": name},
            )

    def __repr__(self) -> str:
        return f"DramatiqAdapter({self.name!r}, {self.settings!r})"

    @classmethod
    def from_options(
        cls, name: str, options_: Mapping[str, Any], *, publish_timeout_s: float
    ) -> DramatiqAdapter:
        return cls(name, dramatiq_settings.DramatiqSettings.parse(name, options_, publish_timeout_s))

    def open(self) -> None:
        if self._amqp is not None:
            self._amqp.deadline.opening()  # the batch after open shares its deadline
            self._amqp.open()
        else:
            assert self._redis is not None
            self._redis.open()

    def ping(self) -> None:
        if self._amqp is not None:
            self._amqp.deadline.start()
            self._amqp.ping()
        else:
            assert self._redis is not None
            self._redis.ping()

    def close(self) -> None:
        if self._amqp is not None:
            self._amqp.close()
        if self._redis is not None:
            self._redis.close()

    def submit(self, jobs: Sequence[models.StagedJob], /) -> Any:
        """Hand the batch to the broker; ``collect`` returns its results (PipelinedAdapter)."""
        build = functools.partial(
            dramatiq_message.build,
            now_ms=int(time.time() * 1000),
            allowed=self.settings.allowed_actors,
            max_bytes=self.settings.max_message_bytes,
            redis=self._redis is not None,
        )
        built, rejected = backend.build_each(jobs, build, BACKEND_NAME)
        if self._redis is not None:
            # A script's reply comes back within one round trip: publish now, hand back the results.
            return [*rejected, *self._redis.publish([message for _job, message in built])]
        link = self._amqp
        assert link is not None
        deadline = link.deadline.start()
        ticket = amqp_confirms.Ticket(results=rejected, deadline=deadline)
        if not built:
            return ticket
        link.ensure_ready()
        queues = dict.fromkeys(message.queue for _job, message in built)
        now = time.monotonic()  # declaring takes at most half of what is left of the call
        waiting = link.declare(queues, now + (deadline - now) / 2)
        ready: list[tuple[models.StagedJob, Any]] = []
        for job, message in built:
            reason = waiting[message.queue]
            if reason is None:
                ready.append((job, dramatiq_rabbitmq.wire(message)))
            else:
                ticket.results.append(models.PublishResult.retry(job, reason))
        link.send(ticket, ready)
        return ticket

    def collect(self, ticket: Any, /) -> list[models.PublishResult]:
        if isinstance(ticket, amqp_confirms.Ticket):
            assert self._amqp is not None
            if ticket.deadline is not None:
                self._amqp.deadline.until(ticket.deadline)
            return self._amqp.collect(ticket)
        results: list[models.PublishResult] = ticket
        return results

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        return self.collect(self.submit(jobs))
