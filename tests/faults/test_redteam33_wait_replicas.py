"""Red team 33: ``wait_replicas`` and the retry of a batch whose ``WAIT`` timed out (G1). Tried; it holds.

The RQ backend acknowledges a batch only once ``wait_replicas`` replicas have it (Redis ``WAIT``
on the link's one connection, which now also carries the packed script call). When ``WAIT``
times out, the batch is unsettled and the rows go again; the relay closes the backend and opens
it again, so the retry runs on a new connection, where the script finds each job's mark and
writes nothing (SKIPPED). Had ``WAIT`` on a connection that wrote nothing answered at once, the
rows would be deleted while no replica had their jobs, and a failover would lose them: what
``wait_replicas`` is documented to close (docs/operations/high-availability.md). Redis 7.0
makes such a ``WAIT`` wait too; this keeps it so.

The replica is frozen (SIGSTOP): its master still counts it online (until repl-timeout), it
acknowledges nothing. The rows must wait until a replica has the jobs; once it is back, the
retry settles them, without a duplicate.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from drain_adapters.rq import adapter as rq_adapter
from drain_adapters.rq import message as rq_message

from drain import errors, models
from tests.support import jobs, redis_server


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[tuple[redis_server.RedisServer, redis_server.RedisServer]]:
    with redis_server.replicated(tmp_path) as pair:
        yield pair


def test_a_retried_batch_is_acknowledged_only_once_a_replica_has_it(
    replicated: tuple[redis_server.RedisServer, redis_server.RedisServer],
) -> None:
    master, replica = replicated
    assert replica.process is not None
    adapter = rq_adapter.RQAdapter.from_options(
        "default",
        {
            "url": master.url,
            "allowed_jobs": ["json.dumps"],
            "wait_replicas": 1,
            "wait_timeout_s": 0.3,
            "socket_timeout_s": 3.0,
        },
        publish_timeout_s=5,
    )
    job = jobs.staged(1, "rt33-wait")
    key = rq_message.job_key(str(job.job_id))
    with contextlib.closing(master.client()) as on_master:
        replica.process.send_signal(signal.SIGSTOP)  # online for its master, acknowledging nothing
        try:
            adapter.open()
            with pytest.raises(errors.BackendUnavailable, match="wait_replicas"):
                adapter.publish_batch([job])
            assert on_master.exists(key) == 1, "the script wrote the job; only the WAIT failed"
            adapter.close()  # what the relay does with a backend found unavailable

            adapter.open()
            # The retry: the job carries this row's mark (SKIPPED). No replica has it yet, so it
            # must not be acknowledged (the row would be deleted, and a failover now loses it).
            with pytest.raises(errors.BackendUnavailable, match="wait_replicas"):
                results = adapter.publish_batch([job])
                pytest.fail(f"acknowledged with no replica holding the job: {results}")
            adapter.close()
        finally:
            replica.process.send_signal(signal.SIGCONT)
        adapter.open()
        try:
            results = adapter.publish_batch([job])
        finally:
            adapter.close()
        assert [result.outcome for result in results] == [models.Outcome.PUBLISHED]
        with contextlib.closing(replica.client()) as on_replica:
            assert on_replica.exists(key) == 1, "acknowledged: the replica has it"
            assert on_replica.llen(rq_message.queue_key("rt33-wait")) == 1, "no duplicate"
