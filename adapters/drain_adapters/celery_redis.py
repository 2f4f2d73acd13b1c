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
above it. A batch is one MULTI/EXEC pipeline, so its reply acknowledges every LPUSH in it.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis
from kombu.utils import json as kombu_json

from drain import errors, models
from drain_adapters import celery_message

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


Wire = tuple[celery_message.CeleryMessage, str]


def wire(message: celery_message.CeleryMessage) -> Wire:
    """The message and the envelope text kombu would store for it. A queue named like one of
    kombu's own keys is refused: a list there would break the workers' bookkeeping."""
    queue = message.routing_key
    if queue in KOMBU_KEYS or queue.startswith(KOMBU_PREFIXES) or PRIORITY_SEPARATOR in queue:
        raise errors.JobRefused(f"queue {queue[:100]!r} is a name kombu's Redis transport uses itself")
    return message, envelope(message)


@contextlib.contextmanager
def translated(name: str) -> Iterator[None]:
    """redis-py's connection-level failures as BackendUnavailable (no URL, no password)."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError) as exc:
        raise errors.BackendUnavailable(f"celery backend {name} (redis): {type(exc).__name__}") from None
    except redis.ResponseError as exc:
        # OOM, READONLY replica, MISCONF: the server refuses every write alike.
        reason = str(exc).split("\n", 1)[0][:200]
        raise errors.BackendUnavailable(
            f"celery backend {name} (redis) refused the write: {reason}"
        ) from None


class RedisPublisher:
    """LPUSH a batch of Celery messages in one transaction; PUBLISHED once Redis replied."""

    def __init__(self, name: str, url: str, timeout_s: float) -> None:
        self.name = name
        self._url = url
        self._timeout_s = timeout_s
        self._client: redis.Redis[bytes] | None = None

    def open(self) -> None:
        self.close()
        try:
            self._client = redis.Redis.from_url(
                self._url,
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                health_check_interval=30,
            )
        except ValueError as exc:  # a URL query redis-py refuses; its text may quote the URL
            raise errors.BackendUnavailable(
                f"celery backend {self.name} (redis): the broker_url is refused: {type(exc).__name__}"
            ) from None
        self.ping()

    def ping(self) -> None:
        with translated(self.name):
            self._live().ping()

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def _live(self) -> redis.Redis[bytes]:
        if self._client is None:
            self.open()
        assert self._client is not None
        return self._client

    def publish(self, messages: Sequence[Wire]) -> list[models.PublishResult]:
        """Write every message; raise BackendUnavailable when Redis did not acknowledge them."""
        if not messages:
            return []
        with translated(self.name):
            pipe = self._live().pipeline(transaction=True)
            for message, text in messages:
                pipe.lpush(list_key(message.routing_key, message.properties["priority"]), text)
            # A command failing inside EXEC (WRONGTYPE: the queue's key holds no list) fails
            # that job alone; an error for the whole transaction (OOM, READONLY) still raises.
            replies = pipe.execute(raise_on_error=False)
        results: list[models.PublishResult] = []
        for (message, _text), reply in zip(messages, replies, strict=True):
            if isinstance(reply, redis.ResponseError):
                reason = f"celery: redis refused the LPUSH: {str(reply).split(chr(10), 1)[0][:200]}"
                results.append(models.PublishResult.rejected(message.job, reason))
            else:
                results.append(models.PublishResult.published(message.job))
        return results
