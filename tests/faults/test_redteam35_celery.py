"""Red team on two Celery changes: the drain's own protocol-2 builder (``celery_message.Protocol2``,
``probe``) and the Celery-on-AMQP batch write on a slow link (``amqp_frames.Chunk``,
``ConfirmTracker.unsent``, ``_flush``, ``_last_look``).

Findings:

- One row whose message the link cannot carry within the publish timeout stops every row of the
  backend behind it: through a 500 KB/s link with ``publish_timeout_s = 2``, a batch headed by a
  row of 3 MB and ten small rows is an outage on every call (BackendUnavailable, 0 of the 10 small
  rows published in 3 calls), while the same ten rows alone are published at once. The relay
  retries the same head, so the backend never moves again: a row blocks the rest without any
  evidence against the backend. (Not new with the chunked write: the head's bytes sit before the
  small rows' on one TCP stream either way; the cut write or the missing confirms end each call
  as an outage.) Fix (opinion): once a proven connection carried a batch's other messages but not
  a lone message's bytes (its write cut, or no confirm of a batch whose head alone exceeds
  rate x timeout), do not call it an outage: write messages larger than a chunk after the small
  ones of other ordering keys (or alone, in a batch of their own), and count an attempt for a
  lone message that was cut, so that it ends dead-lettered instead of stalling the backend.
  Fixed: a message a write chunk's size or more is written after the others of its batch (unless
  another row of its ordering key is in the batch); the ten small rows are published on every call and the
  large row alone waits (RETRY, uncounted) while the link cannot carry it in time.

- (Low; not in the two changes: ``_expires`` is shared by both builders.) An ISO ``expires`` is sent
  re-rendered by ``datetime.isoformat``, not as given, so the ``expires`` header is not what
  ``send_task(expires=<that text>)`` writes (``as_task_v2`` keeps a text as it is):
  ``2030-01-01T00:00:00Z`` goes as ``2030-01-01T00:00:00+00:00``, ``...00.000+02:00`` loses its
  ``.000``, ``20300101T000000+0000`` and ``2030-W01-1T00:00+00:00`` become extended dates. Same
  instant each time. Fix (opinion): keep the normalised form (every worker's parser reads it,
  while Celery's own ``parse_iso8601`` may not read the basic or week forms) and say so in the
  module docstring, rather than passing the text through.
  Kept and documented in celery/message.py (the test stays a strict xfail).

Held (pass): see the ``test_held_*`` functions below, and, measured by hand (not kept as tests,
they need minutes or a private broker): 12,000 random JSON values (huge ints, -0.0, 1e300, astral
and combining characters, quotes, backslashes, NUL, 60-key objects, lists up to 60 wide, strings
near 1,024 characters, maxsize 1-1,100, maxlevels 0-5 and None): ``_saferepr_of`` is Celery's
``saferepr`` each time; 120 rows of 20 KB through a 300 KB/s link, 2 s timeout: all published in
5 calls (9.9 s), 128 messages for 120 rows (at most 2 copies), none rejected; a memory alarm set
0.3 s into a 4 MB batch through a 1 MB/s link on a private broker: 6 PUBLISHED (each in the
queue), 34 RETRY, none REJECTED, the calls during the alarm are outages (no batch written into
it), all 40 published after the alarm, 42 messages for 40 rows; a batch of a 5 MB row, a
1 MiB row and small rows (more than a chunk, more than frame_max) on loopback: all PUBLISHED, one
message each; none of the adapter's caches goes stale: ``origin`` is computed each batch (the drain
never forks), the limits come from the drain's own app, which no setting of the section changes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from drain_adapters import celery as celery_backend
from drain_adapters.amqp import confirms as amqp_confirms
from drain_adapters.amqp import frames as amqp_frames
from drain_adapters.celery import message as celery_message

import drain
from drain import models
from tests.faults.test_redteam35_levers import Throttle, adapter, row
from tests.support import celery_rig, ledger, load, processes, rabbit
from tests.support.waiting import wait_until


def _job(n: int) -> models.StagedJob:
    return models.StagedJob(
        id=n,
        job_id=uuid.UUID(int=n),
        job_name="app.tasks.send",
        args=[n],
        kwargs={},
        queue="q",
        backend="default",
        options={},
        created_at=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
    )


def test_a_row_the_link_cannot_carry_in_time_does_not_stop_the_rows_behind_it() -> None:
    rabbit.need_rabbitmq()
    throttle = Throttle(5672, rate=500_000)
    (queue,) = names = (rabbit.unique_name("rc-head"),)
    small_published = 0
    attempts: list[str] = []
    try:
        with rabbit.queues(rabbit.SHARED_URL, *names):
            celery = adapter(f"amqp://guest:guest@127.0.0.1:{throttle.port}//", publish_timeout_s=2)
            celery.open()
            try:
                head = row(queue, 1, args=["x" * 3_000_000])
                small = [row(queue, n) for n in range(2, 12)]
                for _attempt in range(3):  # the relay retries the same rows, the head first
                    try:
                        results = celery.publish_batch([head, *small])
                    except drain.BackendUnavailable:
                        attempts.append("an outage")
                        continue
                    outcomes = {r.row_id: r.outcome for r in results}
                    attempts.append(str(sorted((k, v.value) for k, v in outcomes.items())))
                    small_published += sum(outcomes[job.id] is models.Outcome.PUBLISHED for job in small)
                alone = celery.publish_batch(small)  # the same rows without the head: at once
                assert [r.outcome for r in alone] == [models.Outcome.PUBLISHED] * 10
            finally:
                celery.close()
    finally:
        throttle.close()
    print(f"calls with the 3 MB head: {attempts}; small rows published: {small_published}")
    assert small_published > 0, "the head row stops every row behind it on every call"


@pytest.mark.xfail(
    strict=True,
    reason="kept, documented in celery/message.py: an ISO expires is sent in the extended form "
    "(the same instant), where send_task passes the text on as given",
)
@pytest.mark.parametrize(
    "expires", ["2030-01-01T00:00:00Z", "2030-01-01T00:00:00.000+02:00", "20300101T000000+0000"]
)
def test_an_iso_expires_is_the_header_send_task_writes(expires: str) -> None:
    app = celery_message.new_app()
    job = dataclasses.replace(celery_message._probe_jobs(1024)[0], options={"expires": expires})
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    ours = celery_message.build(app, job, reply_to="r", now=now, protocol=celery_message.Protocol2.of(app))
    headers, _properties, _body, _event = app.amqp.as_task_v2(
        str(job.job_id), job.job_name, list(job.args), dict(job.kwargs), expires=expires
    )
    assert ours.headers["expires"] == headers["expires"]


# --- Held ---------------------------------------------------------------------------------------


def test_held_tags_given_back_are_the_next_batchs_and_a_multiple_ack_settles_each_once() -> None:
    """A batch of 5 leaves its last 2 unwritten (tags 4, 5 given back); the next batch of 3 takes
    4, 5, 6 as the broker numbers them; a multiple ack of 5 publishes 1-3 of the first and the
    next's first two, a nack of 6 retries its third; nothing counted twice."""
    tracker = amqp_confirms.ConfirmTracker("celery")
    tracker.restart()
    first, second = amqp_confirms.Ticket(), amqp_confirms.Ticket()
    jobs = [_job(n) for n in range(1, 9)]
    for job in jobs[:5]:
        tracker.sent(first, job, 10)
    tracker.unsent(first, 2, "not written")
    for job in jobs[5:]:
        tracker.sent(second, job, 10)
    assert sorted(second.pending) == [4, 5, 6]
    tracker.confirmed(5, multiple=True, acked=True)
    tracker.confirmed(5, multiple=True, acked=True)  # a repeated ack changes nothing
    tracker.confirmed(6, multiple=False, acked=False)
    assert [(r.row_id, r.outcome) for r in first.results] == [
        (4, models.Outcome.RETRY),
        (5, models.Outcome.RETRY),
        (1, models.Outcome.PUBLISHED),
        (2, models.Outcome.PUBLISHED),
        (3, models.Outcome.PUBLISHED),
    ]
    assert [(r.row_id, r.outcome) for r in second.results] == [
        (6, models.Outcome.PUBLISHED),
        (7, models.Outcome.PUBLISHED),
        (8, models.Outcome.RETRY),
    ]
    assert not first.pending and not second.pending and tracker.outstanding == 0


def test_held_out_of_order_confirms_and_a_return_before_its_ack() -> None:
    tracker = amqp_confirms.ConfirmTracker("celery")
    ticket = amqp_confirms.Ticket()
    jobs = [_job(n) for n in range(1, 5)]
    for job in jobs:
        tracker.sent(ticket, job, 1)
    tracker.returned(str(jobs[2].job_id), "unroutable", retry=True)
    tracker.confirmed(3, multiple=False, acked=True)
    tracker.confirmed(1, multiple=False, acked=True)
    tracker.confirmed(4, multiple=True, acked=True)  # 2 and 4 (3 and 1 settled already)
    outcomes = {r.row_id: r.outcome for r in ticket.results}
    assert outcomes == {
        1: models.Outcome.PUBLISHED,
        2: models.Outcome.PUBLISHED,
        3: models.Outcome.RETRY,
        4: models.Outcome.PUBLISHED,
    }
    assert len(ticket.results) == 4


@pytest.mark.parametrize("sizes", [[10], [2_000_000], [600_000, 600_000, 10], [1 << 20, 1, 1 << 20]])
def test_held_chunks_hold_whole_messages_in_order(sizes: list[int]) -> None:
    frames = amqp_frames.PublishFrames(1, 131_072)
    whole = []
    for size in sizes:
        frames.add("", "q", b"\x00\x00", b"b" * size, mandatory=True)
        one = amqp_frames.PublishFrames(1, 131_072)
        one.add("", "q", b"\x00\x00", b"b" * size, mandatory=True)
        whole.append(b"".join(chunk.data for chunk in one.writes()))
    chunks = list(frames.writes())
    assert sum(chunk.messages for chunk in chunks) == len(sizes)
    assert b"".join(chunk.data for chunk in chunks) == b"".join(whole)
    at = 0
    for chunk in chunks:
        assert chunk.data == b"".join(whole[at : at + chunk.messages])
        at += chunk.messages


def test_held_the_probe_and_the_builder_agree_for_json_odd_values() -> None:
    app = celery_message.new_app()
    protocol = celery_message.Protocol2.of(app)
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    values: list[Any] = [
        [10**300, -0.0, 1.0, 1e300, 5e-324, "\U0001f600e\u0301", "a'\\\"\n\x00"],
        ["x" * 1019],  # "['" + 1019 + "']" = 1023 characters
        ["x" * 1020],  # 1024: the limit itself
        ["x" * 1021],  # 1025: cut by Celery
        [{"": {"not an identifier": [[[]]]}}],
        [{str(n): n for n in range(300)}],
        [[[[[[["deep"]]]]]]],
    ]
    base = celery_message._probe_jobs(1024)[0]
    for args in values:
        job = dataclasses.replace(base, args=args, kwargs={"k": args})
        ours = celery_message.build(app, job, reply_to="r", now=now, protocol=protocol)
        celerys = celery_message.build(app, job, reply_to="r", now=now)
        assert celery_message.difference(ours, celerys) is None, args


ODD_ARGS: list[Any] = [
    10**40,
    -0.0,
    1.0,
    1e300,
    "\U0001f600e\u0301 a'b\\c\"d\n\x01",  # no NUL: jsonb holds none
    "x" * 1019,
    {"": {"not an identifier": [[[]]], "k": None}},
    [[[[[["deep"]]]]]],
]


def test_held_a_real_worker_runs_the_drains_message_with_odd_arguments(database: str, tmp_path: Path) -> None:
    """The drain's own builder (the probe passed) on RabbitMQ: an unmodified ``celery worker``
    runs each task with the task id, args and kwargs staged."""
    rabbit.need_rabbitmq()
    queue = rabbit.unique_name("rc-worker")
    ledger.install(database)
    worker = celery_rig.start_worker(rabbit.SHARED_URL, queue, database, tmp_path / "worker.log")
    rows = [
        row(queue, 1, job_name=load.JOB_NAME, args=ODD_ARGS, kwargs={"odd": ODD_ARGS, "ключ": 1}),
        row(queue, 2, job_name=load.JOB_NAME, args=[], kwargs={}),
        row(queue, 3, job_name=load.JOB_NAME, args=[{str(n): n for n in range(300)}], kwargs={}),
    ]
    try:
        with processes.running(worker):
            celery_rig.wait_ready(worker)
            celery = celery_backend.CeleryAdapter.from_options(
                "rc", {"broker_url": rabbit.SHARED_URL, "allowed_jobs": ["tests.**"]}, publish_timeout_s=5
            )
            celery.open()
            try:
                assert celery._fast_builder(), "the probe passed: the drain's own builder"
                results = celery.publish_batch(rows)
            finally:
                celery.close()
            assert [r.outcome for r in results] == [models.Outcome.PUBLISHED] * 3

            def ran() -> list[Any]:
                with psycopg.connect(database) as conn:
                    return conn.execute("SELECT job_id, args, kwargs FROM deliveries").fetchall()

            try:
                wait_until("the worker to run the tasks", lambda: len(ran()) == 3, 30)
            except AssertionError:
                raise AssertionError(f"ran {len(ran())}: " + worker.output()[-4000:]) from None
    finally:
        celery_rig.forget_queue(rabbit.SHARED_URL, queue)
    seen = {str(job_id): (args, kwargs) for job_id, args, kwargs in ran()}
    with psycopg.connect(database) as conn:  # what was staged, through jsonb as deliveries holds it
        for job in rows:
            staged = conn.execute(
                "SELECT %s::jsonb, %s::jsonb", (json.dumps(list(job.args)), json.dumps(dict(job.kwargs)))
            ).fetchone()
            assert staged is not None
            assert seen[str(job.job_id)] == (staged[0], staged[1])


def test_the_rabbitmq_backend_too_publishes_the_rows_behind_a_row_the_link_cannot_carry_in_time() -> None:
    """The first finding on the `rabbitmq` backend (pika, not the chunked writer): through the
    same 500 KB/s link, a 3 MB row ahead of ten small ones was "no confirm within 2.0s" on every
    call, 0 of the 10 published. The large message now goes last in the shared AMQP link's send,
    so the ten are confirmed on every call and the large row alone retries."""
    from drain_adapters import rabbitmq

    rabbit.need_rabbitmq()
    throttle = Throttle(5672, rate=500_000)
    (queue,) = names = (rabbit.unique_name("rc-head-rmq"),)
    small_published = 0
    try:
        with rabbit.queues(rabbit.SHARED_URL, *names):
            url = f"amqp://guest:guest@127.0.0.1:{throttle.port}/%2F"
            backend = rabbitmq.RabbitMQAdapter.from_options("levers", {"url": url}, publish_timeout_s=2)
            backend.open()
            try:
                head = row(queue, 1, args=["x" * 3_000_000])
                small = [row(queue, n) for n in range(2, 12)]
                for _attempt in range(3):
                    try:
                        results = backend.publish_batch([head, *small])
                    except drain.BackendUnavailable:
                        continue
                    outcomes = {r.row_id: r.outcome for r in results}
                    assert outcomes[head.id] is models.Outcome.RETRY, "the large row waits, uncounted"
                    small_published += sum(outcomes[job.id] is models.Outcome.PUBLISHED for job in small)
            finally:
                backend.close()
    finally:
        throttle.close()
    assert small_published == 30, small_published


def test_a_large_message_keeps_its_place_before_a_later_row_of_its_ordering_key() -> None:
    """Moving a large message last must change no key's order: the relay's batches hold at most
    one row of a key, but a caller's batch of two rows of one key, the first large, is written as
    given; an unkeyed large row and one alone in its key still go last."""
    from drain_adapters import rabbitmq

    rabbit.need_rabbitmq()
    (queue,) = names = (rabbit.unique_name("rc-keyed"),)
    big = "x" * (amqp_frames.WRITE_CHUNK_BYTES + 10)
    with rabbit.queues(rabbit.SHARED_URL, *names):
        options = {"url": rabbit.SHARED_URL}
        backend = rabbitmq.RabbitMQAdapter.from_options("levers", options, publish_timeout_s=10)
        backend.open()
        try:
            batch = [
                row(queue, 1, args=[big], ordering_key="k"),
                row(queue, 2, args=[big]),
                row(queue, 3, args=[big], ordering_key="alone"),
                row(queue, 4, ordering_key="k"),
                row(queue, 5),
            ]
            results = backend.publish_batch(batch)
            assert all(r.outcome is models.Outcome.PUBLISHED for r in results)
        finally:
            backend.close()
        order = [str(job.job_id) for job in batch]
        held = list(rabbit.take_all(rabbit.SHARED_URL, queue))
    assert [order.index(message_id) + 1 for message_id in held] == [1, 4, 5, 2, 3]
