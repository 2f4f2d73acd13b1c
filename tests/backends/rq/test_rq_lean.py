"""The lean enqueue writes what RQ's own ``Queue.enqueue_many`` writes, field by field (issue 17).

For the same job, RQ's ``enqueue_many`` runs first and its writes are read back (the job hash, the
queue list, the ``rq:queues`` set, the job's TTL) and removed; then the drain's adapter forwards
the same job and its writes are read back. Every hash field must be equal, except the timestamps
(compared by presence and RQ's format) and ``drain_staged_row`` (the drain's own mark, present
only on its side). Then ``rq info`` lists the lean job and an unmodified ``rq worker`` runs it.
"""

from __future__ import annotations

import datetime
import subprocess
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import rq
from drain_adapters import rq as rq_adapter
from drain_adapters.rq import message as rq_message
from rq import job as rq_job
from rq import serializers
from rq import utils as rq_utils

from drain import models
from tests.support import processes

TIMESTAMPS = {b"created_at", b"enqueued_at"}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("pickle", {}),
    ("json", {}),
    (
        "pickle",
        {
            "timeout": 30,
            "result_ttl": 60,
            "failure_ttl": -1,
            "ttl": 600,
            "retry": {"max": 3, "interval": [1, 5]},
            "description": "the welcome mail",
            "meta": {"tenant": "ü", "n": [1, 2]},
        },
    ),
    ("json", {"timeout": -1, "retry": {"max": 2, "interval": 7}, "at_front": True, "meta": {"a": 1.5}}),
    ("pickle", {"result_ttl": 0, "at_front": False}),
]


@pytest.fixture
def client(redis_db: str) -> Iterator[redis.Redis[bytes]]:
    the_client: redis.Redis[bytes] = redis.Redis.from_url(redis_db)
    yield the_client
    the_client.close()


def snapshot(client: redis.Redis[bytes], queue: str, job_id: str) -> dict[str, Any]:
    key = rq_job.Job.key_for(job_id)
    return {
        "hash": client.hgetall(key),
        "queue": client.lrange(f"rq:queue:{queue}", 0, -1),
        "queues": client.sismember("rq:queues", f"rq:queue:{queue}"),
        "ttl": client.ttl(key),
        "keys": sorted(k for k in client.keys("*") if k != b"drain-test:claim"),
    }


def forget(client: redis.Redis[bytes], queue: str, job_id: str) -> None:
    client.delete(rq_job.Job.key_for(job_id), f"rq:queue:{queue}")
    client.srem("rq:queues", f"rq:queue:{queue}")


def with_rq(
    client: redis.Redis[bytes], serializer: str, queue: str, job_id: str, opts: dict[str, Any]
) -> None:
    retry = opts.get("retry")
    data = rq.Queue.prepare_data(
        "json.dumps",
        args=[["a@example.com", 2, {"deep": [1, {"x": None}]}]],
        kwargs={"sort_keys": True},
        timeout=opts.get("timeout"),
        result_ttl=opts.get("result_ttl"),
        ttl=opts.get("ttl"),
        failure_ttl=opts.get("failure_ttl"),
        description=opts.get("description"),
        job_id=job_id,
        at_front=opts.get("at_front", False),
        meta=opts.get("meta"),
        retry=rq.Retry(max=retry["max"], interval=retry.get("interval", 0)) if retry else None,
    )
    queue_ = rq.Queue(queue, connection=client, serializer=serializer)
    pipe = client.pipeline()
    queue_.enqueue_many([data], pipeline=pipe)
    pipe.execute()


def with_drain(redis_url: str, serializer: str, queue: str, job_id: str, opts: dict[str, Any]) -> None:
    adapter = rq_adapter.RQAdapter.from_options(
        "default",
        {"url": redis_url, "serializer": serializer, "allowed_jobs": ["json.dumps"]},
        publish_timeout_s=5,
    )
    adapter.open()
    try:
        job = models.StagedJob(
            id=1,
            job_id=uuid.UUID(job_id),
            job_name="json.dumps",
            args=[["a@example.com", 2, {"deep": [1, {"x": None}]}]],
            kwargs={"sort_keys": True},
            queue=queue,
            backend="default",
            options=opts,
            created_at=datetime.datetime.now(datetime.UTC),
        )
        (result,) = adapter.publish_batch([job])
        assert result.outcome is models.Outcome.PUBLISHED, result
    finally:
        adapter.close()


@pytest.mark.parametrize(("serializer", "opts"), CASES)
def test_lean_enqueue_writes_what_enqueue_many_writes(
    client: redis.Redis[bytes], redis_db: str, serializer: str, opts: dict[str, Any]
) -> None:
    queue, job_id = f"drain-lean-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
    with_rq(client, serializer, queue, job_id, opts)
    theirs = snapshot(client, queue, job_id)
    forget(client, queue, job_id)
    with_drain(redis_db, serializer, queue, job_id, opts)
    ours = snapshot(client, queue, job_id)

    mark = ours["hash"].pop(rq_message.MARK_FIELD)
    assert mark.startswith(b"1:")
    assert set(ours["hash"]) == set(theirs["hash"]), set(ours["hash"]) ^ set(theirs["hash"])
    for field, value in theirs["hash"].items():
        if field in TIMESTAMPS:
            assert rq_utils.utcparse(ours["hash"][field].decode()), field
            assert len(ours["hash"][field]) == len(value), field
        elif field == b"data":
            loads = (
                serializers.JSONSerializer.loads
                if serializer == "json"
                else serializers.DefaultSerializer.loads
            )
            assert loads(zlib.decompress(ours["hash"][field])) == loads(zlib.decompress(value))
        else:
            assert ours["hash"][field] == value, (field, ours["hash"][field], value)
    assert ours["queue"] == theirs["queue"] == [job_id.encode()]
    assert ours["queues"] and theirs["queues"]
    assert ours["keys"] == theirs["keys"]
    assert (ours["ttl"] == -1) == (theirs["ttl"] == -1)
    assert abs(ours["ttl"] - theirs["ttl"]) <= 2


def test_rq_info_lists_the_lean_job_and_a_plain_worker_runs_it(
    client: redis.Redis[bytes], redis_db: str
) -> None:
    queue, job_id = f"drain-lean-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
    with_drain(redis_db, "pickle", queue, job_id, {"meta": {"tenant": "a"}})
    env = processes.environment("postgresql://unused")
    info = subprocess.run(
        [processes.RQ, "info", "--url", redis_db, "--only-queues", queue],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert info.returncode == 0, info.stderr
    assert info.stdout.splitlines()[0].startswith(f"{queue} |"), info.stdout
    assert "1 queues, 1 jobs total" in info.stdout, info.stdout
    assert rq.Queue(queue, connection=client).count == 1
    worker = subprocess.run(
        [
            processes.RQ,
            "worker",
            "--burst",
            "--url",
            redis_db,
            "--worker-class",
            "rq.worker.SimpleWorker",
            queue,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert worker.returncode == 0, worker.stdout + worker.stderr
    job = rq_job.Job.fetch(job_id, connection=client)
    assert job.get_status() == "finished", job.latest_result().exc_string if job.latest_result() else None
    assert job.return_value() == '["a@example.com", 2, {"deep": [1, {"x": null}]}]'
    assert job.meta == {"tenant": "a"}
    assert client.hget(job.key, rq_message.MARK_FIELD), "the worker's writes kept the drain's mark"
