"""Dramatiq on Redis: a job id written at most once while its message is held (G4), a queue
whose key holds another type makes its own jobs wait (RETRY), and a server refusing every write
is an outage (G10): nothing rejected, nothing dead-lettered, the same adapter publishing again
once the server heals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from drain_adapters import dramatiq

from drain import errors, models
from tests.support import jobs, redis_refusals, redis_server

ACTOR = "app.record"


def adapter(url: str) -> Any:
    built = dramatiq.DramatiqAdapter.from_options(
        "d", {"url": url, "allowed_actors": [ACTOR]}, publish_timeout_s=5
    )
    built.open()
    return built


def test_a_job_forwarded_again_while_held_is_not_written_twice(redis_db: str) -> None:
    """The duplicate a crash between Redis's reply and the database commit would make."""
    backend = adapter(redis_db)
    client = redis.Redis.from_url(redis_db)
    try:
        batch = [jobs.staged(i, "emails", ACTOR) for i in range(1, 21)]
        fresh = jobs.staged(21, "emails", ACTOR)
        first = backend.publish_batch(batch)
        again = backend.publish_batch([*batch[5:], fresh])
        assert {r.outcome for r in [*first, *again]} == {models.Outcome.PUBLISHED}
        ids = [item.decode() for item in client.lrange("dramatiq:emails", 0, -1)]
        assert sorted(ids) == sorted(f"{job.job_id}:{job.id}" for job in [*batch, fresh])
        assert client.hlen("dramatiq:emails.msgs") == 21
    finally:
        backend.close()
        client.close()


def test_a_queue_key_of_another_type_makes_only_its_jobs_wait(redis_db: str) -> None:
    backend = adapter(redis_db)
    client = redis.Redis.from_url(redis_db)
    try:
        client.set("dramatiq:broken", "not a list")
        batch = [jobs.staged(i, "broken" if i % 2 else "fine", ACTOR) for i in range(1, 11)]
        results = {r.row_id: r for r in backend.publish_batch(batch)}
        for job in batch:
            expected = models.Outcome.RETRY if job.queue == "broken" else models.Outcome.PUBLISHED
            assert results[job.id].outcome is expected, results[job.id]
        assert client.llen("dramatiq:fine") == 5
        assert client.hlen("dramatiq:broken.msgs") == 0  # nothing half written
    finally:
        backend.close()
        client.close()


def acl_on_keys(server: redis_server.RedisServer) -> redis_refusals.Heal:
    """The drain's user may touch only keys it does not use: Redis refuses the script's keys
    before it runs (NOPERM naming a key)."""
    client = server.client()
    client.execute_command("ACL", "SETUSER", "default", "resetkeys", "~elsewhere:*")
    return lambda: client.execute_command("ACL", "SETUSER", "default", "allkeys")


@pytest.mark.parametrize(
    "refusal",
    [
        redis_refusals.REFUSALS[0],
        redis_refusals.REFUSALS[1],
        redis_refusals.acl_revoking("default", "-rpush"),
        redis_refusals.Refusal("NOPERM", acl_on_keys),
    ],
    ids=["READONLY", "OOM", "ACL-command", "ACL-keys"],
)
def test_a_server_refusing_every_write_is_an_outage_until_it_heals(
    refusal: redis_refusals.Refusal, tmp_path: Path
) -> None:
    with redis_server.running(tmp_path / "redis") as server:
        backend = adapter(server.url)
        try:
            backend.publish_batch([jobs.staged(0, "q", ACTOR)])
            heal = refusal.inject(server)
            with pytest.raises(errors.BackendUnavailable):
                backend.publish_batch([jobs.staged(i, "q", ACTOR) for i in range(1, 6)])
            heal()
            backend.close()
            backend.open()
            results = backend.publish_batch([jobs.staged(i, "q", ACTOR) for i in range(1, 6)])
            assert {r.outcome for r in results} == {models.Outcome.PUBLISHED}
            assert server.client().llen("dramatiq:q") == 6
        finally:
            backend.close()
