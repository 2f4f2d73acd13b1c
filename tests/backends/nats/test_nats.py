"""The NATS JetStream backend on a real server (the shared one, streams of the test's own).

- G1/G4: the drain killed (``os._exit``, like SIGKILL) between the PubAck and the DELETE, three
  times over (bench/bench_nats.py: five): each restart publishes the acknowledged-but-staged
  jobs again with the same ``Nats-Msg-Id``, and the stream holds every committed job exactly
  once (JetStream dropped the re-publishes as duplicates inside its window).
- The window's edge: a re-publish after the stream's ``duplicate_window`` is stored again, a
  duplicate the consumer sees, with the same job id.
- What the server answers, one case each: a stream at its limit with ``discard: new`` makes its
  rows wait (RETRY, nothing dead-lettered), and so do those of a subject no stream covers (a
  stream deleted dead-lettered every row of its queues, once); a message over the stream's
  ``max_msg_size`` is that row's rejection; the rest of the batch is published.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from drain_adapters import nats

from drain import errors, models
from tests.support import configs, faultload, jetstream, jobs, ledger, processes, rabbit
from tests.support.waiting import wait_until

BACKEND = "events"
COMMITTED = 600
KILLS = 3


@pytest.fixture(autouse=True)
def _need_nats() -> None:
    jetstream.need_nats()


def staged_ids(dsn: str) -> set[uuid.UUID]:
    with psycopg.connect(dsn) as conn:
        return {row[0] for row in conn.execute("SELECT job_id FROM staged_jobs")}


def adapter_for(stream: str, **options: object) -> nats.NatsAdapter:
    return nats.NatsAdapter.from_options(
        "test", {"url": jetstream.SHARED_URL, "subject_prefix": stream, **options}, publish_timeout_s=10
    )


def test_kills_between_the_ack_and_the_delete_leave_each_job_once_in_the_stream(
    database: str, tmp_path: Path
) -> None:
    stream = jetstream.unique_name("CRASH")
    queues = ("email", "reports")
    with jetstream.stream(stream, [f"{stream}.*"]):
        committed = rabbit.stage_jobs(database, COMMITTED, queues, BACKEND, per_txn=200)
        section = {
            "type": "nats",
            "url": jetstream.SHARED_URL,
            "subject_prefix": stream,
            "queues": list(queues),
        }
        config = configs.write_config(tmp_path / "drain.toml", database, {BACKEND: section}, batch_size=40)
        republished = 0
        for kill in range(KILLS):
            crashed = processes.start_drain(
                config, None, tmp_path / f"crashed{kill}.log", failpoints="after_publish=exit@2"
            )
            assert crashed.wait() == 137, crashed.output()
            with_rows = {str(job_id) for job_id in staged_ids(database)}
            in_stream = {str(job_id) for job_id in jetstream.held(stream)}
            window = with_rows & in_stream  # acknowledged, still staged: published again on restart
            assert window, f"kill {kill}: no job acknowledged and left staged"
            republished += len(window)
        finisher = processes.start_drain(config, None, tmp_path / "finisher.log", "--once")
        assert finisher.wait() == 0, finisher.output()
        held = jetstream.held(stream)
    tally = ledger.Tally(
        committed={uuid.UUID(job_id) for job_id in committed},
        delivered=collections.Counter(held),
        remaining=rabbit.staged_count(database),
    )
    faultload.report(f"nats: {KILLS} kills between ack and delete", tally, republished=republished)
    tally.check()
    assert tally.remaining == 0
    assert tally.duplicates == 0, "JetStream stored a re-publish inside its duplicate window"


def test_a_republish_after_the_window_is_a_duplicate_the_consumer_sees() -> None:
    stream = jetstream.unique_name("WINDOW")
    window_s = 1.0
    with jetstream.stream(stream, [f"{stream}.*"], duplicate_window=window_s):
        adapter = adapter_for(stream)
        adapter.open()
        try:
            job = jobs.staged(1, "q")
            assert adapter.publish_batch([job])[0].outcome is models.Outcome.PUBLISHED
            assert adapter.publish_batch([job])[0].outcome is models.Outcome.PUBLISHED  # a duplicate
            assert jetstream.held(stream) == {job.job_id: 1}, "a re-publish inside the window was stored"
            started = time.monotonic()
            wait_until("the duplicate window to pass", lambda: time.monotonic() - started > window_s * 1.5, 5)
            assert adapter.publish_batch([job])[0].outcome is models.Outcome.PUBLISHED
        finally:
            adapter.close()
        copies = jetstream.messages(stream)
    assert [message.headers["Nats-Msg-Id"] for message in copies] == [f"{job.job_id}:{job.id}"] * 2
    assert copies[0].data == copies[1].data  # the same job, the same id: the consumer dedupes by it


def test_each_refusal_is_placed_and_the_rest_of_the_batch_published() -> None:
    stream = jetstream.unique_name("REFUSE")
    with jetstream.stream(stream, [f"{stream}.small", f"{stream}.full"], max_msg_size=2048):
        full = jetstream.unique_name("FULL")
        with jetstream.stream(full, [f"{stream}.limited"], max_msgs=1, discard="new"):
            adapter = adapter_for(stream)
            adapter.open()
            try:
                batch = [jobs.staged(n, "small") for n in range(1, 11)]
                batch[2] = dataclasses.replace(batch[2], args=["x" * 4000])  # over max_msg_size
                batch[4] = dataclasses.replace(batch[4], queue="nowhere")  # no stream covers it
                batch[6] = dataclasses.replace(batch[6], queue="limited")  # fills that stream
                batch[7] = dataclasses.replace(batch[7], queue="limited")  # finds it full
                results = {result.row_id: result for result in adapter.publish_batch(batch)}
                alone = adapter.publish_batch([dataclasses.replace(batch[7], id=11)])
            finally:
                adapter.close()
            assert jetstream.held(full) == {batch[6].job_id: 1}
        held = jetstream.held(stream)
    outcomes = {row: result.outcome for row, result in results.items()}
    assert outcomes.pop(3) is models.Outcome.REJECTED, results[3]
    assert "maximum" in (results[3].error or "")
    assert outcomes.pop(5) is models.Outcome.RETRY, results[5]  # the topology's, not the row's
    assert "no stream covers" in (results[5].error or "")
    assert outcomes.pop(8) is models.Outcome.RETRY, results[8]  # the full stream's rows wait
    assert [result.outcome for result in alone] == [models.Outcome.RETRY]  # alone: no outage either
    assert set(outcomes.values()) == {models.Outcome.PUBLISHED}
    assert set(held) == {batch[n].job_id for n in (0, 1, 3, 5, 8, 9)}


def test_open_names_the_queue_no_stream_covers() -> None:
    stream = jetstream.unique_name("OPEN")
    with jetstream.stream(stream, [f"{stream}.email"]):
        adapter = adapter_for(stream, queues=["email", "reports"])
        try:
            with pytest.raises(
                errors.BackendUnavailable, match=rf"no stream covers subject '{stream}\.reports'"
            ):
                adapter.open()
        finally:
            adapter.close()


def test_a_batch_written_on_a_dropped_connection_fails_at_once_not_at_its_deadline() -> None:
    """Its PubAcks cannot come on the connection made since: collect does not wait for them. Its
    jobs RETRY (the server may hold them or not) and the connection made since is kept: the
    contract suite's rule for a batch lost with its connection (an outage here would drop the
    new connection and the batches on it, duplicates without a crash)."""
    stream = jetstream.unique_name("DROPPED")
    with jetstream.stream(stream, [f"{stream}.*"]):
        adapter = adapter_for(stream, publish_timeout_s=8)
        adapter.open()
        try:
            ticket = adapter.submit([jobs.staged(n, "q") for n in range(1, 4)])
            adapter.close()
            adapter.open()
            started = time.monotonic()
            results = adapter.collect(ticket)
            assert time.monotonic() - started < 2.0
            assert {result.outcome for result in results} == {models.Outcome.RETRY}
            assert adapter.publish_batch([jobs.staged(9, "q")])[0].outcome is models.Outcome.PUBLISHED
        finally:
            adapter.close()
