"""The Celery backend: each staged job becomes the task message ``send_task`` would send.

A row becomes ``app.send_task(job_name, args, kwargs, task_id=job_id, queue=queue, ...)``'s
message, the bytes Celery's own builder makes (``celery_message``: protocol 2, JSON; made by the
drain's builder once a probe found this Celery makes the same), so an unmodified ``celery worker``
consuming that queue runs it and cannot tell it from ``send_task``'s. It is published without
``send_task``'s one-confirm-at-a-time wait:

- RabbitMQ (``amqp://``, ``amqps://``, ``pyamqp://``): batches with many publisher confirms
  outstanding, mandatory, persistent (``celery_amqp``); each queue declared first as ``send_task``
  declares it (``celery_queues``, with the section's ``task_create_missing_queues``,
  ``task_create_missing_queue_type`` and ``task_default_queue_type``); a job whose queue is
  missing all the same is REJECTED.
- Redis (``redis://``, ``rediss://``, and kombu's ``sentinel://...;sentinel://...`` with
  ``broker_transport_options = {master_name = ...}``): one MULTI/EXEC pipeline per batch, laid
  out as kombu's Redis transport lays it out (``celery_redis``); the reply is the
  acknowledgement (with ``wait_replicas``, once that many replicas have the batch).

Any other transport would publish without an acknowledgement, and so does ``confirm_publish =
false``: both are refused by the settings (``drain check`` and ``drain run`` say why in one line).
``allowed_jobs`` limits the task names a row may name (``**`` is allowed: Celery looks a name up
in its task registry, it never walks attribute chains); without it ``drain check`` and ``drain
run`` warn once.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from drain import backend, errors, models
from drain_adapters.celery import amqp_publisher as celery_amqp
from drain_adapters.celery import message as celery_message
from drain_adapters.celery import queues as celery_queues
from drain_adapters.celery import redis_publisher as celery_redis
from drain_adapters.celery import settings as celery_settings

log = logging.getLogger(__name__)

# The public names of the backend, wherever they live.
DEFAULT_URL = celery_settings.DEFAULT_URL
CelerySettings = celery_settings.CelerySettings


class CeleryAdapter:
    """Forward staged jobs as Celery tasks; see the module docstring."""

    def __init__(self, name: str, settings: CelerySettings) -> None:
        self.name = name
        self.settings = settings
        self._app = celery_message.new_app()
        self._fast: bool | None = None  # the drain's own message builder: None until probed
        self._amqp: celery_amqp.AmqpPublisher | None = None
        self._redis: celery_redis.RedisPublisher | None = None
        if settings.transport == "redis":
            self._redis = celery_redis.RedisPublisher(
                name, settings.redis_target or settings.broker_url, settings.publish_timeout_s, settings.wait
            )
        else:
            for key, value in settings.queue_settings.items():
                setattr(self._app.conf, key, value)
            app = self._app
            self._amqp = celery_amqp.AmqpPublisher(
                name,
                celery_amqp.AmqpAddress.parse_all(settings.broker_url),
                publish_timeout_s=settings.publish_timeout_s,
                connect_timeout_s=settings.connect_timeout_s,
                declarations=lambda queue: celery_queues.of(app, queue),
            )
        if settings.allowed_jobs is None:
            log.warning(
                "backend %s: no allowed_jobs; any row can make the Celery workers run any registered "
                'task (set allowed_jobs = ["app.tasks.*"])',
                name,
                extra={"event": "no_allowed_jobs", "backend": name},
            )

    def __repr__(self) -> str:
        return f"CeleryAdapter({self.name!r}, {self.settings!r})"

    @classmethod
    def from_options(
        cls, name: str, options_: Mapping[str, Any], *, publish_timeout_s: float
    ) -> CeleryAdapter:
        return cls(name, CelerySettings.parse(name, options_, publish_timeout_s))

    def _fast_builder(self) -> bool:
        """Whether this app's messages are built by the drain (``celery_message.probe`` found them
        equal to Celery's); probed once, and a difference is logged once."""
        if self._fast is None:
            found = celery_message.probe(self._app)
            self._fast = found is None
            if found is not None:
                log.warning(
                    "backend %s: Celery's builder makes other messages than the drain's here (%s); "
                    "each message is built by Celery's as_task_v2 (slower)",
                    self.name,
                    found,
                    extra={"event": "celery_builder_differs", "backend": self.name},
                )
        return self._fast

    def open(self) -> None:
        self._fast_builder()
        if self._amqp is not None:
            self._amqp.open()
        else:
            assert self._redis is not None
            self._redis.open()

    def ping(self) -> None:
        if self._amqp is not None:
            self._amqp.ping()
        else:
            assert self._redis is not None
            self._redis.ping()

    def problems(self) -> list[str]:
        """What the drain needs on the broker and does not find (``drain check``): on Redis, the
        default queue's list writable by the drain's user. On AMQP the drain declares each queue
        as ``send_task`` would, and ``ping`` proved it may publish: nothing more to ask."""
        if self._redis is None:
            return []
        return self._redis.problems([self._app.conf.task_default_queue])

    def close(self) -> None:
        if self._amqp is not None:
            self._amqp.close()
        if self._redis is not None:
            self._redis.close()

    def _build(self, now: datetime.datetime) -> Callable[[models.StagedJob], Any]:
        """The function turning one row into what this broker is sent (``build_each``'s)."""
        app = self._app
        reply_to = app.thread_oid  # what send_task puts in reply_to
        allowed = self.settings.allowed_jobs
        max_bytes = self.settings.max_message_bytes
        to_wire = celery_amqp.wire if self._amqp is not None else celery_redis.wire
        protocol = celery_message.Protocol2.of(app) if self._fast_builder() else None

        admitted: dict[str, bool] = {}  # a batch's job names, matched once each

        def build(job: models.StagedJob) -> Any:
            if allowed is not None:
                admits = admitted.get(job.job_name)
                if admits is None:
                    admits = admitted[job.job_name] = allowed.admits(job.job_name)
                if not admits:
                    raise errors.JobRefused(f"task {job.job_name!r} is not in allowed_jobs")
            message = celery_message.build(app, job, reply_to=reply_to, now=now, protocol=protocol)
            if len(message.body) > max_bytes:
                raise errors.JobRefused(f"message of {len(message.body)} bytes exceeds max_message_bytes")
            return to_wire(message)

        return build

    def submit(self, jobs: Sequence[models.StagedJob], /) -> Any:
        """Hand the batch to the broker; ``collect`` returns its results (PipelinedAdapter)."""
        built, rejected = backend.build_each(jobs, self._build(datetime.datetime.now(datetime.UTC)), "celery")
        wires = [wire for _job, wire in built]
        if self._amqp is not None:
            return self._amqp.submit(wires, celery_amqp.Ticket(results=rejected))
        assert self._redis is not None
        # A Redis pipeline reply comes back within one round trip: publish now, hand back the results.
        return [*rejected, *self._redis.publish(wires)]

    def collect(self, ticket: Any, /) -> list[models.PublishResult]:
        if isinstance(ticket, celery_amqp.Ticket):
            assert self._amqp is not None
            return self._amqp.collect(ticket)
        results: list[models.PublishResult] = ticket
        return results

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        return self.collect(self.submit(jobs))
