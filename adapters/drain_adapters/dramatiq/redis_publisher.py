"""Dramatiq messages onto Redis as Dramatiq's Redis broker enqueues them, one script call per batch.

``RedisBroker.enqueue`` runs the ``enqueue`` command of its ``dispatch.lua``: ``HSET
<namespace>:<queue>.msgs <redis_message_id> <message>`` and ``RPUSH <namespace>:<queue>
<redis_message_id>``; a worker LPOPs the id and reads the message from the hash. Here one
script (SCRIPT) does that for every job of a batch, so a batch costs one round trip, and the
reply is the acknowledgement (with ``wait_replicas``, once that many replicas have it). Per job:

1. ``HSETNX`` of the message under its id (``<job id>:<row id>``): when the hash already holds
   that id, this row was forwarded before and is still queued or running (a crash between
   Redis's reply and the database commit): nothing is written, reply SKIPPED;
2. otherwise RPUSH of the id; reply WRITTEN. Both run under ``pcall``.

One command both checks and writes the hash, where ``HEXISTS`` then ``HSET`` took two.

What ``dispatch.lua`` does besides, the drain leaves to the workers: it records no heartbeat (a
producer is no worker) and runs no maintenance (the workers run it).

A write Redis refuses undoes that job's hash entry. ``WRONGTYPE`` (a queue's key holds another
type) concerns the whole queue: that job is RETRY and the script goes on with the next; any
other refusal stops the script and the backend is unavailable (a replica, OOM, MISCONF, an ACL
refusing a command or a queue's key: ``redis_errors``), the rows waiting untouched. The jobs
written before it are skipped when they come again (step 1). A script is atomic: no worker sees
a job half written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis

from drain import errors, models
from drain_adapters.dramatiq import message as dramatiq_message
from drain_adapters.redis import client as redis_client
from drain_adapters.redis import errors as redis_errors
from drain_adapters.redis import settings as redis_settings

WRITTEN, SKIPPED = 0, 1
QUEUE_WIDE_CODE = "WRONGTYPE"

# KEYS: per job, its queue's list, then its queue's hash. ARGV: per job, its id, then its message.
SCRIPT = """
local out = {}
for j = 1, #KEYS / 2 do
  local list, hash = KEYS[2 * j - 1], KEYS[2 * j]
  local id, data = ARGV[2 * j - 1], ARGV[2 * j]
  local failed = nil
  local r = redis.pcall('HSETNX', hash, id, data)
  if type(r) == 'table' and r.err then
    failed = r.err
  elseif r == 0 then
    out[j] = 1
  else
    r = redis.pcall('RPUSH', list, id)
    if type(r) == 'table' and r.err then
      failed = r.err
      redis.pcall('HDEL', hash, id)
    else
      out[j] = 0
    end
  end
  if failed then
    out[j] = redis.error_reply(failed)
    if string.sub(failed, 1, 9) ~= 'WRONGTYPE' then
      return out
    end
  end
end
return out
"""
SHA = hashlib.sha1(SCRIPT.encode(), usedforsecurity=False).hexdigest()


def keys(namespace: str, queue: str) -> tuple[str, str]:
    """The queue's list and hash, as ``dispatch.lua`` names them."""
    list_key = f"{namespace}:{queue}"
    return list_key, f"{list_key}.msgs"


class RedisPublisher:
    """Enqueue a batch of Dramatiq messages in one script call; PUBLISHED once Redis replied."""

    def __init__(
        self,
        name: str,
        target: str | redis_client.SentinelTarget,
        *,
        namespace: str,
        timeout_s: float,
        wait: redis_settings.Wait,
    ) -> None:
        self._label = f"dramatiq backend {name} (redis)"
        self._target = target
        self._namespace = namespace
        self._timeout_s = timeout_s
        self._wait = wait
        self._link: redis_client.RedisLink | None = None

    def open(self) -> None:
        self.close()
        try:
            self._link = redis_client.RedisLink(self._target, self._timeout_s)
        except ValueError as exc:  # a URL query redis-py refuses; its text may quote the URL
            raise errors.BackendUnavailable(
                f"{self._label}: the url is refused: {type(exc).__name__}"
            ) from None
        self._link.deadline.opening()  # the batch after open shares its deadline
        with redis_errors.translated(self._label):
            self._link.client.ping()
            self._wait.ready(self._client(), self._label)

    def ping(self) -> None:
        with redis_errors.translated(self._label):
            self._started().ping()

    def close(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.close()

    def _client(self) -> Any:
        if self._link is None:
            raise errors.BackendUnavailable(f"{self._label} is not open")
        return self._link.client

    def _started(self) -> Any:
        """The client, a call's deadline started (``drain.backend.deadline``)."""
        client = self._client()
        assert self._link is not None
        self._link.deadline.start()
        return client

    def publish(self, messages: Sequence[dramatiq_message.DramatiqMessage]) -> list[models.PublishResult]:
        """Enqueue every message; raise BackendUnavailable when Redis did not take the batch."""
        if self._link is not None:  # every call starts its deadline, one that sends nothing too
            self._link.deadline.start()
        if not messages:
            return []
        keys_: list[str] = []
        argv: list[str | bytes] = []
        for message in messages:
            keys_.extend(keys(self._namespace, message.queue))
            argv.append(message.message_id)
            argv.append(message.body)
        try:
            with redis_errors.translated(self._label):
                client = self._client()
                try:
                    replies = client.evalsha(SHA, len(keys_), *keys_, *argv)
                except redis.exceptions.NoScriptError:  # a Redis restarted or failed over
                    client.script_load(SCRIPT)
                    replies = client.evalsha(SHA, len(keys_), *keys_, *argv)
                self._wait.check(client, self._label)
        except redis.ResponseError as exc:
            # an ACL refusing a queue's key before the script ran: the drain's permissions, no row's
            raise redis_errors.unavailable(self._label, exc) from None
        results: list[models.PublishResult] = []
        for message, reply in zip(messages, replies, strict=False):
            if not isinstance(reply, Exception):
                results.append(models.PublishResult.published(message.job))
            elif redis_errors.code(reply) == QUEUE_WIDE_CODE:
                reason = (
                    f"dramatiq: a key of queue {message.queue!r} holds another type: "
                    f"{redis_errors.reason(reply)}"
                )
                results.append(models.PublishResult.retry(message.job, reason))
            else:
                raise redis_errors.unavailable(self._label, reply)
        if len(results) != len(messages):
            raise errors.BackendUnavailable(
                f"{self._label}: the script replied for {len(results)} of {len(messages)} jobs"
            )
        return results
