"""Celery messages onto Redis as kombu's Redis transport lays them out; the pipeline reply is the ack.

kombu's virtual transport wraps each message in a JSON envelope::

    {"body": <base64 of the serialised body>, "content-encoding": "utf-8",
     "content-type": "application/json", "headers": {...the task headers...},
     "properties": {"correlation_id", "reply_to", "delivery_mode", "priority", ["expiration"],
                    "delivery_info": {"exchange": "", "routing_key": <queue>},
                    "body_encoding": "base64", "delivery_tag": <a fresh uuid4>}}

and publishing to the default exchange ``""`` LPUSHes it onto the list named by the routing key
(the worker BRPOPs the other end). A priority other than 0 goes to the list
``<queue>\\x06\\x16<step>``, the step being the highest of kombu's priority steps (0, 3, 6, 9) not
above it. A batch is one MULTI/EXEC pipeline, so its reply acknowledges every LPUSH in it (with
``wait_replicas``, once that many replicas have it too). A refusal of the whole server (OOM,
READONLY, MISCONF, an ACL refusal of any key: ``redis_errors``) raises BackendUnavailable and
the rows wait untouched; an LPUSH refused because its queue's list holds another type
(WRONGTYPE) makes that queue's rows wait (RETRY, no attempt counted). No refusal from Redis
rejects a row. Redis is reached by URL or through
Sentinel (kombu's ``sentinel://`` URLs: ``redis_client``, ``redis_settings``).

Memory: a batch is built whole before its pipeline is sent, so each message is held once, as the
envelope's bytes (redis-py sends bytes as they are; a ``str`` it would encode again, all of the
batch at once), and the message beside it keeps no body of its own (the envelope carries it).
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kombu.utils import json as kombu_json

from drain import errors, models
from drain_adapters.celery import message as celery_message
from drain_adapters.redis import client as redis_client
from drain_adapters.redis import errors as redis_errors
from drain_adapters.redis import probes as redis_probes
from drain_adapters.redis import settings as redis_settings

PRIORITY_STEPS = (0, 3, 6, 9)  # kombu's redis transport default priority_steps
MIN_PRIORITY, MAX_PRIORITY = 0, 9  # kombu's virtual channel clamps priorities to 0-9
PRIORITY_SEPARATOR = "\x06\x16"
BODY_ENCODING = "base64"
# kombu's own keys in the broker's db (its defaults): the unacked-message bookkeeping, the
# exchange bindings and fanout channels; Celery's result keys when results share the db.
KOMBU_KEYS = frozenset(("unacked", "unacked_index", "unacked_mutex"))
KOMBU_PREFIXES = ("_kombu.", "/", "celery-task-meta-", "celery-taskset-meta-")
_json_dumps: Callable[..., str] = kombu_json.dumps  # kombu's, untyped


def list_key(queue: str, priority: int) -> str:
    """The Redis list kombu's ``_put`` pushes a message of this priority onto."""
    clamped = max(min(priority, MAX_PRIORITY), MIN_PRIORITY)
    step = PRIORITY_STEPS[bisect.bisect(PRIORITY_STEPS, clamped) - 1]
    return f"{queue}{PRIORITY_SEPARATOR}{step}" if step else queue


def envelope(message: celery_message.CeleryMessage) -> str:
    """The JSON kombu's Redis transport stores for this message."""
    properties: dict[str, Any] = dict(message.properties)
    priority = properties.pop("priority")  # kombu adds it after delivery_info: keep its order
    properties["delivery_info"] = {"exchange": message.exchange, "routing_key": message.routing_key}
    properties["priority"] = priority
    properties["body_encoding"] = BODY_ENCODING
    properties["delivery_tag"] = str(uuid.uuid4())
    return _json_dumps(
        {
            "body": base64.b64encode(message.body).decode("ascii"),
            "content-encoding": message.content_encoding,
            "content-type": message.content_type,
            "headers": message.headers,
            "properties": properties,
        }
    )


Wire = tuple[celery_message.CeleryMessage, bytes]


def wire(message: celery_message.CeleryMessage) -> Wire:
    """The message (without its body) and the envelope kombu would store for it, as bytes (the
    envelope is ASCII: kombu's JSON escapes the rest). A queue named like one of kombu's own keys
    is refused: a list there would break the workers' bookkeeping."""
    queue = message.routing_key
    if queue in KOMBU_KEYS or queue.startswith(KOMBU_PREFIXES) or PRIORITY_SEPARATOR in queue:
        raise errors.JobRefused(f"queue {queue[:100]!r} is a name kombu's Redis transport uses itself")
    return dataclasses.replace(message, body=b""), envelope(message).encode()


class RedisPublisher:
    """LPUSH a batch of Celery messages in one transaction; PUBLISHED once Redis replied."""

    def __init__(
        self,
        name: str,
        target: str | redis_client.SentinelTarget,
        timeout_s: float,
        wait: redis_settings.Wait = redis_settings.Wait(),  # noqa: B008 - frozen
    ) -> None:
        self.name = name
        self._label = f"celery backend {name} (redis)"
        self._target = target
        self._timeout_s = timeout_s
        self._wait = wait
        self._link: redis_client.RedisLink | None = None

    def open(self) -> None:
        self.close()
        try:
            self._link = redis_client.RedisLink(self._target, self._timeout_s)
        except ValueError as exc:  # a URL query redis-py refuses; its text may quote the URL
            raise errors.BackendUnavailable(
                f"{self._label}: the broker_url is refused: {type(exc).__name__}"
            ) from None
        self._link.deadline.opening()  # the batch after open shares its deadline
        with redis_errors.translated(self._label):
            self._link.client.ping()
            self._wait.ready(self._live(), self._label)

    def ping(self) -> None:
        with redis_errors.translated(self._label):
            self._started().ping()

    def problems(self, queues: Sequence[str]) -> list[str]:
        """The lists of these queues hold another type, or the drain's user may not write them
        (``redis_probes``: nothing is written)."""
        with redis_errors.translated(self._label):
            return redis_probes.key_problems(self._started(), [(queue, "list") for queue in queues])

    def close(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.close()

    def _live(self) -> Any:
        if self._link is None:
            self.open()
        assert self._link is not None
        return self._link.client

    def _started(self) -> Any:
        """The client, a call's deadline started (``drain.backend.deadline``)."""
        client = self._live()
        assert self._link is not None
        self._link.deadline.start()
        return client

    def publish(self, messages: Sequence[Wire]) -> list[models.PublishResult]:
        """Write every message; raise BackendUnavailable when Redis did not acknowledge them."""
        if self._link is not None:  # every call starts its deadline, one that sends nothing too
            self._link.deadline.start()
        if not messages:
            return []
        with redis_errors.translated(self._label):
            client = self._live()
            pipe = client.pipeline(transaction=True)
            for message, text in messages:
                pipe.lpush(list_key(message.routing_key, message.properties["priority"]), text)
            # An error for the whole transaction (a refusal when queueing: READONLY, OOM) raises;
            # one inside EXEC is that LPUSH's reply, decided below.
            replies = pipe.execute(raise_on_error=False)
            self._wait.check(client, self._label)
        results: list[models.PublishResult] = []
        for (message, _text), reply in zip(messages, replies, strict=True):
            key = list_key(message.routing_key, message.properties["priority"])
            if not isinstance(reply, Exception):
                results.append(models.PublishResult.published(message.job))
            elif redis_errors.wrong_type(reply):  # the queue's own list holds another type
                reason = f"celery: the Redis key {key[:100]!r} is not a list: {redis_errors.reason(reply)}"
                results.append(models.PublishResult.retry(message.job, reason))
            else:
                raise redis_errors.unavailable(self._label, reply, key)
        return results
