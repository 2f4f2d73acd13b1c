"""Red team (NATS JetStream backend): refusals that are not the row's own fault.

Finding 1: a stream deleted (or deleted and re-created, as an operator changing a setting the
server cannot edit does) while the drain runs turns every job of its subjects into a REJECTED
row: the publish finds no responders, ``$JS.API.STREAM.NAMES`` answers "no stream", and the
adapter calls that the row's own fault. Every row of every queue the stream covered is counted an
attempt and, at ``max_attempts``, dead-lettered. A missing stream is the queue's (or the whole
backend's) condition, exactly like RabbitMQ's NO_ROUTE for a deleted queue, which
docs/guarantees.md ("Whose fault is a refusal") makes a RETRY: "refusals of a whole backend or
queue dead-letter nothing" (G6). Here even a queue listed in the backend's ``queues`` (one the
operator declared a stream must cover, checked at ``open``) is rejected.

Finding 2: with least-privilege publish permissions (the drain's user may publish only to the
subjects of its queues), one row whose ``queue`` names another subject makes the server answer
``-ERR 'Permissions Violation for Publish to ...'``. The adapter keeps it as the connection's
``refusal`` and fails every job of the batch still awaiting its PubAck: the rows beside the bad
one (most of the batch: only the PubAcks read before the -ERR count) come back RETRY (or, when
none had come yet, the whole batch is BackendUnavailable), the connection is dropped and made
again, and the bad row itself is RETRY, never counted, never dead-lettered. Since it is first in
every batch, every batch repeats this for ever: one row's queue throttles the whole backend to a
few rows and a reconnect per batch (G6: "a row that cannot be delivered, by its own fault, never
blocks the rows behind it"). Seen: only a few of the 28 good rows published per batch.
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from pathlib import Path

import psycopg
import pytest
from drain_adapters import nats

from drain import errors, models
from tests import conftest
from tests.support import configs, faultload, jetstream, jobs, processes, rabbit
from tests.support.waiting import wait_until


def adapter_for(url: str, prefix: str, **options: object) -> nats.NatsAdapter:
    return nats.NatsAdapter.from_options(
        "test", {"url": url, "subject_prefix": prefix, **options}, publish_timeout_s=5
    )


def test_a_stream_deleted_mid_run_rejects_no_row() -> None:
    jetstream.need_nats()
    stream = jetstream.unique_name("RTGONE")
    adapter = adapter_for(jetstream.SHARED_URL, stream, queues=["email"])
    try:
        with jetstream.stream(stream, [f"{stream}.*"]):
            adapter.open()  # the stream covers the configured queue
            first = adapter.publish_batch([jobs.staged(n, "email") for n in range(1, 6)])
            assert {result.outcome for result in first} == {models.Outcome.PUBLISHED}
        # the operator deletes the stream (to re-create it with other settings, say)
        try:
            results = adapter.publish_batch([jobs.staged(n, "email") for n in range(6, 16)])
        except errors.BackendUnavailable:
            results = []  # an outage: the rows wait untouched, as expected
    finally:
        adapter.close()
    rejected = [result for result in results if result.outcome is models.Outcome.REJECTED]
    assert not rejected, f"{len(rejected)} rows REJECTED for a missing stream: {rejected[0].error}"


def test_a_drain_run_dead_letters_nothing_while_the_stream_is_recreated(
    database: str, tmp_path: Path
) -> None:
    """Finding 1 end to end: ``drain run`` (max_attempts 3, retry_base_s 0.05), 60 rows staged
    while the stream is gone for 4 s, then the stream is back; counted: dead letters."""
    jetstream.need_nats()
    stream = jetstream.unique_name("RTRECREATE")
    section = {"type": "nats", "url": jetstream.SHARED_URL, "subject_prefix": stream, "queues": ["email"]}
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"b": section}, max_attempts=3, retry_max_s=0.5
    )
    jetstream.add_stream([jetstream.SHARED_URL], stream, [f"{stream}.*"])
    running = processes.start_drain(config, None, tmp_path / "drain.log")
    try:
        first = rabbit.stage_jobs(database, 20, ("email",), "b")
        wait_until("the first rows forwarded", lambda: rabbit.staged_count(database) == 0, 30)
        jetstream.delete_stream([jetstream.SHARED_URL], stream)  # the operator re-creates it ...
        later = rabbit.stage_jobs(database, 60, ("email",), "b")
        time.sleep(4)
        jetstream.add_stream([jetstream.SHARED_URL], stream, [f"{stream}.*"])  # ... seconds later
        wait_until("the table empty", lambda: rabbit.staged_count(database) == 0, 60)
        held = stored_ids(stream)
    finally:
        running.terminate()
        jetstream.delete_stream([jetstream.SHARED_URL], stream)
    with psycopg.connect(database) as conn:
        dead_row = conn.execute("SELECT count(*) FROM staged_jobs_dead").fetchone()
    dead = int(dead_row[0]) if dead_row else 0
    print(
        f"committed {len(first | later)} after the re-creation {len(later)} delivered {len(held)} dead {dead}"
    )
    assert dead == 0, f"{dead} of the {len(later)} rows staged meanwhile dead-lettered"
    assert later <= held


def stored_ids(stream: str) -> set[str]:
    """The job ids the stream holds (none when it is empty: reading an empty stream fails)."""
    try:
        return set(map(str, jetstream.held(stream)))
    except Exception:  # an empty stream: get_msg of sequence 0 is a bad request
        return set()


NATS_CONF = """
listen: 127.0.0.1:{port}
jetstream {{ store_dir: "{store}" }}
authorization {{
  users = [
    {{ user: drain, password: s3cret-pw,
       permissions: {{ publish: {{ allow: ["{prefix}.email", "$JS.API.INFO", "$JS.API.STREAM.NAMES"] }},
                       subscribe: {{ allow: ["_INBOX.>"] }} }} }},
    {{ user: admin, password: admin-pw }}
  ]
}}
"""


@pytest.fixture
def private_nats(tmp_path: Path):  # type: ignore[no-untyped-def]
    binary = conftest.need_binary("nats-server", "nats-server")
    port = faultload.free_port()
    prefix = jetstream.unique_name("RTPERM")
    conf = tmp_path / "nats.conf"
    conf.write_text(NATS_CONF.format(port=port, store=tmp_path / "js", prefix=prefix))
    process = subprocess.Popen(
        [binary, "-c", str(conf), "-l", str(tmp_path / "nats.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until("private nats-server", lambda: conftest.port_open("127.0.0.1", port), 20)
        yield port, prefix
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_one_row_on_a_denied_subject_does_not_stall_the_backend(private_nats) -> None:  # type: ignore[no-untyped-def]
    port, prefix = private_nats
    admin = f"nats://admin:admin-pw@127.0.0.1:{port}"
    jetstream.add_stream([admin], prefix, [f"{prefix}.>"])
    adapter = adapter_for(
        f"nats://127.0.0.1:{port}", prefix, user="drain", password="s3cret-pw", queues=["email"]
    )
    adapter.open()
    outcomes: list[list[models.Outcome] | str] = []
    try:
        for _round in range(3):  # the relay's next tries: the same rows, in id order
            batch = [jobs.staged(1, "hostile")] + [jobs.staged(n, "email") for n in range(2, 30)]
            try:
                outcomes.append([result.outcome for result in adapter.publish_batch(batch)])
            except errors.BackendUnavailable as exc:
                outcomes.append(f"outage: {exc}")
            time.sleep(0.2)
    finally:
        adapter.close()
    for got in outcomes:
        assert not isinstance(got, str), got
        assert got[1:] == [models.Outcome.PUBLISHED] * 28, got


def test_a_row_with_headers_over_64k_is_rejected_not_an_outage() -> None:
    """Finding 3: JetStream refuses a message whose header block exceeds 64 KiB with err_code
    10097 ("header size exceeds maximum allowed of 64k"), a property of that message alone (the
    server's ``max_payload``, 1 MiB, which the adapter checks, is far above). ``messages.build``
    does not check it and ``_deliver`` files 10097 under "any other error": an outage. Alone in a
    batch the row makes the backend unavailable (``drain_backend_up`` 0, backoff for every
    queue); beside others it is RETRY, uncounted, the connection dropped and made again; at every
    step, for ever, never dead-lettered. A 70 KB ``headers`` option value (or a 70 KB job name by
    plain SQL) is all it takes."""
    jetstream.need_nats()
    stream = jetstream.unique_name("RTHDR")
    with jetstream.stream(stream, [f"{stream}.*"]):
        adapter = adapter_for(jetstream.SHARED_URL, stream)
        adapter.open()
        big = dataclasses.replace(jobs.staged(1, "email"), options={"headers": {"x-big": "v" * 70_000}})
        try:
            outcomes = []
            for _round in range(2):
                try:
                    outcomes.append([result.outcome for result in adapter.publish_batch([big])])
                except errors.BackendUnavailable as exc:
                    outcomes.append([f"outage: {exc}"])  # type: ignore[list-item]
        finally:
            adapter.close()
    assert outcomes == [[models.Outcome.REJECTED]] * 2, outcomes
