"""Red team (Dramatiq backend on Redis): a row's queue name that is another Dramatiq key.

Dramatiq's Redis broker keeps, under its namespace, a list per queue (``<ns>:<queue>``), a hash
of its messages (``<ns>:<queue>.msgs``), the workers' heartbeats (a sorted set,
``<ns>:__heartbeats__``), each worker's acks and the dead-letter queues. The adapter's queue
check (``QUEUE_NAME``, the ``.DQ``/``.XQ`` suffixes) lets through names that ARE those keys:

- ``__heartbeats__``: the drain RPUSHes onto ``<ns>:__heartbeats__``, creating a list where
  Dramatiq keeps a sorted set. Every later call of Dramatiq's ``dispatch.lua`` starts with
  ``ZADD <ns>:__heartbeats__`` and now fails WRONGTYPE: every worker's fetch and ack and every
  app's ``actor.send()`` on that namespace, until an operator deletes the key. One row's queue
  takes the whole Dramatiq deployment down; the row itself is PUBLISHED.
- ``<queue>.msgs`` (and ``<queue>.XQ.msgs``): written while ``<queue>`` holds no message, the
  drain creates a list at the key that is ``<queue>``'s message hash; from then on every job of
  the legitimate ``<queue>`` meets WRONGTYPE and is RETRY for ever (the row's own fault blocks
  another queue's rows: G6), and the workers of ``<queue>`` fail on HMGET.

Expected: such a row REJECTED with a reason (it can never be a Dramatiq queue here), nothing
written; the rows beside it delivered.
"""

from __future__ import annotations

from typing import Any

import redis
from drain_adapters import dramatiq

from drain import models
from tests.support import jobs

ACTOR = "app.record"


def adapter(url: str) -> Any:
    built = dramatiq.DramatiqAdapter.from_options(
        "d", {"url": url, "allowed_actors": [ACTOR]}, publish_timeout_s=5
    )
    built.open()
    return built


def test_a_queue_named_heartbeats_is_refused_and_dramatiq_keeps_working(redis_db: str) -> None:
    import dramatiq as dramatiq_lib
    from dramatiq.brokers.redis import RedisBroker

    backend = adapter(redis_db)
    client = redis.Redis.from_url(redis_db)
    try:
        batch = [jobs.staged(1, "__heartbeats__", ACTOR), jobs.staged(2, "default", ACTOR)]
        results = {result.row_id: result for result in backend.publish_batch(batch)}
        # what the app's own producer does next: actor.send() through Dramatiq's broker
        broker = RedisBroker(url=redis_db)  # type: ignore[no-untyped-call]
        sent: str | None = None
        try:
            broker.enqueue(
                dramatiq_lib.Message(queue_name="default", actor_name=ACTOR, args=(), kwargs={}, options={})
            )
        except redis.ResponseError as exc:
            sent = str(exc)
        finally:
            broker.close()
    finally:
        backend.close()
        client.close()
    assert results[2].outcome is models.Outcome.PUBLISHED
    assert sent is None, f"Dramatiq's own enqueue now fails: {sent}"
    assert results[1].outcome is models.Outcome.REJECTED, results[1]


def test_a_queue_named_like_another_queues_hash_does_not_block_that_queue(redis_db: str) -> None:
    backend = adapter(redis_db)
    try:
        hostile = backend.publish_batch([jobs.staged(1, "default.msgs", ACTOR)])
        later = backend.publish_batch([jobs.staged(n, "default", ACTOR) for n in range(2, 7)])
    finally:
        backend.close()
    assert [result.outcome for result in later] == [models.Outcome.PUBLISHED] * 5, later
    assert hostile[0].outcome is models.Outcome.REJECTED, hostile
