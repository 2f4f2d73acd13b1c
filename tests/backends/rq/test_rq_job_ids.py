"""Job ids RQ already holds (issue 10, item 9), and a Redis reply refusing one job of a batch.

- The crash duplicate — the *same* staged row forwarded again because the drain died between
  Redis's reply and its commit — is skipped as published, even after a real ``rq worker`` ran the
  job and saved it (the row's mark in the job hash survives the worker's writes).
- A *new* row reusing a job id that RQ still holds (here a failed job kept for its failure_ttl)
  is REJECTED with a reason naming the id, not silently dropped.
- A write Redis refuses for one job of the batch's script rejects that job alone and removes
  what it wrote, so its retry is not mistaken for its own earlier forward; a queue key that is
  not a list rejects the rows for that queue and is left alone.
"""

from __future__ import annotations

import dataclasses
import datetime
import subprocess
import uuid
from collections.abc import Iterator

import pytest
import redis
import rq
from drain_adapters import rq as rq_adapter
from drain_adapters.rq import message as rq_message
from rq import job as rq_job
from rq import registry

from drain import errors, models
from tests.support import processes


@pytest.fixture
def adapter(redis_db: str) -> Iterator[rq_adapter.RQAdapter]:
    the_adapter = rq_adapter.RQAdapter.from_options(
        "default", {"url": redis_db, "allowed_jobs": ["json.loads", "json.dumps"]}, publish_timeout_s=5
    )
    the_adapter.open()
    yield the_adapter
    the_adapter.close()


def row(row_id: int, job_id: uuid.UUID, job_name: str, args: list[object], queue: str) -> models.StagedJob:
    return models.StagedJob(
        id=row_id,
        job_id=job_id,
        job_name=job_name,
        args=args,
        kwargs={},
        queue=queue,
        backend="default",
        options={},
        created_at=datetime.datetime.now(datetime.UTC),
    )


def burst(redis_url: str, queue: str) -> None:
    """Run a real ``rq worker`` until the queue is empty."""
    done = subprocess.run(
        [
            processes.RQ,
            "worker",
            "--burst",
            "--url",
            redis_url,
            "--worker-class",
            "rq.worker.SimpleWorker",
            queue,
        ],
        env=processes.environment("postgresql://unused"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def outcome(adapter: rq_adapter.RQAdapter, job: models.StagedJob) -> models.PublishResult:
    (result,) = adapter.publish_batch([job])
    return result


def test_crash_duplicate_skipped_reused_id_rejected(adapter: rq_adapter.RQAdapter, redis_db: str) -> None:
    queue = f"drain-ids-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_db)
    rq_queue = rq.Queue(queue, connection=client)
    failing_id, finishing_id = uuid.uuid4(), uuid.uuid4()
    failing = row(1, failing_id, "json.loads", ["not json"], queue)
    finishing = row(2, finishing_id, "json.dumps", [1], queue)
    assert [r.outcome for r in adapter.publish_batch([failing, finishing])] == [models.Outcome.PUBLISHED] * 2
    burst(redis_db, queue)
    assert str(failing_id) in registry.FailedJobRegistry(queue, connection=client).get_job_ids()
    assert rq_job.Job.fetch(str(finishing_id), connection=client).get_status() == "finished"

    # The same rows again (the drain died before deleting them): skipped, not enqueued twice.
    for same in (failing, finishing):
        assert outcome(adapter, same).outcome is models.Outcome.PUBLISHED
    assert rq_queue.count == 0
    assert rq_job.Job.fetch(str(failing_id), connection=client).get_status() == "failed"

    # A new row (new id, new created_at) reusing the failed job's id: rejected, with the reason.
    restaged = dataclasses.replace(failing, id=3, created_at=datetime.datetime.now(datetime.UTC))
    result = outcome(adapter, restaged)
    assert result.outcome is models.Outcome.REJECTED
    assert result.error is not None
    assert f"RQ already holds a job with job_id {failing_id}" in result.error
    assert "new job_id" in result.error
    assert rq_queue.count == 0
    client.close()


def test_a_job_id_enqueued_by_plain_rq_is_not_taken_for_a_crash_duplicate(
    adapter: rq_adapter.RQAdapter, redis_db: str
) -> None:
    queue = f"drain-ids-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_db)
    job_id = uuid.uuid4()
    rq.Queue(queue, connection=client).enqueue("json.dumps", 1, job_id=str(job_id))
    result = outcome(adapter, row(1, job_id, "json.dumps", [2], queue))
    assert result.outcome is models.Outcome.REJECTED
    assert rq.Queue(queue, connection=client).job_ids == [str(job_id)]
    client.close()


def test_a_command_redis_refuses_for_a_job_is_the_backends_and_undone(
    adapter: rq_adapter.RQAdapter, redis_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The net behind validation: a write the script's pcall sees refused is undone, and the
    script stops there naming the key and the error. An error text is no evidence that the row
    is at fault (issue 33), so the backend is unavailable: the rows wait, none is rejected."""
    queue = f"drain-ids-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_db)
    jobs = [row(n, uuid.uuid4(), "json.dumps", [n], queue) for n in range(1, 4)]
    build = adapter.build

    def build_one_bad(job: models.StagedJob, now: bytes) -> rq_message.RQMessage:
        message = build(job, now)
        # A ttl validation would never let through: Redis refuses the EXPIRE after the HSET ran.
        return dataclasses.replace(message, ttl=10**20) if job is jobs[1] else message

    monkeypatch.setattr(adapter, "build", build_one_bad)
    replies = adapter.run_script([build_one_bad(job, rq_message.timestamp()) for job in jobs[1:]])
    assert len(replies) == 1, "the script stops at the refusal"
    key, error = replies[0]
    assert key.decode() == rq_job.Job.key_for(str(jobs[1].job_id)) and b"not an integer" in error

    with pytest.raises(errors.BackendUnavailable, match="ERR value is not an integer"):
        adapter.publish_batch(jobs)
    assert not client.exists(rq_job.Job.key_for(str(jobs[1].job_id)))  # undone: its retry starts clean
    assert rq.Queue(queue, connection=client).job_ids == [str(jobs[0].job_id)]
    client.close()


def test_a_queue_key_that_is_not_a_list_makes_its_rows_wait_and_is_left_alone(
    adapter: rq_adapter.RQAdapter, redis_db: str
) -> None:
    good_queue, bad_queue = (f"drain-ids-{uuid.uuid4().hex[:8]}" for _ in range(2))
    client = redis.Redis.from_url(redis_db)
    client.set(f"rq:queue:{bad_queue}", "not a list")
    jobs = [row(n, uuid.uuid4(), "json.dumps", [n], good_queue if n != 2 else bad_queue) for n in range(1, 4)]
    by_row = {result.row_id: result for result in adapter.publish_batch(jobs)}
    assert by_row[1].outcome is by_row[3].outcome is models.Outcome.PUBLISHED
    assert by_row[2].outcome is models.Outcome.RETRY  # the queue's fault: no attempt counted
    assert by_row[2].error is not None and "is a string, not an RQ queue list" in by_row[2].error
    assert not client.exists(rq_job.Job.key_for(str(jobs[1].job_id)))
    assert client.get(f"rq:queue:{bad_queue}") == b"not a list"
    client.delete(f"rq:queue:{bad_queue}")
    client.close()
