"""The relay against what apps and adapters do to it (issue 10): real Postgres, in-memory backends.

- An app deletes or updates a staged row while the leader's batch holds it: the batch locked it
  (FOR UPDATE SKIP LOCKED), so the app waits for the batch's commit. A row of a pipelined batch in
  flight is not locked: the app's change makes the collecting step's settlement fail with a
  serialization failure (40001), and it is written again in a fresh fenced transaction. Either
  way the leader keeps leading and nothing is forwarded twice.
- An adapter raises something unexpected for one row: that row is REJECTED with the error, the
  rows beside it are published in the same step. If every row raises and the backend fails its
  ping, the backend is unavailable instead (no attempt counted).
- A pipelined batch waits for its confirms at most drain.relay.forward.MAX_AGE_S, even while another
  backend keeps the batches full.
"""

from __future__ import annotations

import collections
import threading

import psycopg
import pytest

import drain
from drain import config, models, testing
from drain.relay import forward
from drain.relay import loop as relay
from tests.conftest import ManualClock
from tests.support import relays
from tests.support.waiting import steps_until, wait_until


def make_relay(
    settings: config.Settings,
    adapters: dict[str, testing.MemoryAdapter],
    clock: ManualClock,
    **changes: object,
) -> relay.Relay:
    return relays.leading(settings, adapters, clock, jitter=0.0, **changes)


def stage(dsn: str, count: int, **job: object) -> list[str]:
    with psycopg.connect(dsn) as conn:
        jobs = [drain.Job("app.t", args=[n], **job) for n in range(count)]  # type: ignore[arg-type]
        return [str(i) for i in drain.stage_many(conn, jobs)]


def rows(dsn: str, table: str = "staged_jobs") -> list[dict[str, object]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cursor:
        return cursor.execute(f"SELECT * FROM {table} ORDER BY id").fetchall()


CHANGES = [
    "DELETE FROM staged_jobs WHERE job_id = %s",  # an app cancels the job
    "UPDATE staged_jobs SET options = '{\"note\": 1}' WHERE job_id = %s",  # or edits it
]


def waiting_on_a_lock(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ).fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("change", CHANGES)
def test_an_app_changing_a_row_the_batch_holds_waits_for_its_commit(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str, change: str
) -> None:
    """The batch's select locks its rows (FOR UPDATE SKIP LOCKED): the app's change waits for
    the batch's commit, then finds the row gone; nothing is forwarded twice, nobody steps down."""
    ids = stage(database, 20)
    pid = leader.leadership.pid
    changed: list[int] = []

    def app_change(job_id: object) -> None:
        with psycopg.connect(database, autocommit=True) as app:
            changed.append(app.execute(change, [job_id]).rowcount)

    app = threading.Thread(target=app_change, args=(None,))

    def behave(job: models.StagedJob) -> testing.Behaviour:
        if not app.is_alive() and not changed:  # during the publish: the row is the batch's
            app._args = (job.job_id,)  # type: ignore[attr-defined]
            app.start()
            wait_until("the app to wait for the row", lambda: waiting_on_a_lock(database), 10)
        return "ack"

    memory.behaviour = behave
    leader.metrics.tick()
    wait = leader.turn()  # the loop's own step, with its error handling
    app.join(timeout=30)
    assert wait == leader.settings.poll_min_s
    assert changed == [0]  # it waited, then found the row forwarded and deleted
    assert leader.leadership.is_leader and leader.leadership.pid == pid  # it did not step down
    published = collections.Counter(str(job.job_id) for job in memory.published)
    assert sorted(published) == sorted(ids) and max(published.values()) == 1  # each once
    assert rows(database) == [] and rows(database, "staged_jobs_dead") == []


@pytest.mark.parametrize("change", CHANGES)
def test_an_app_changing_a_row_in_flight_is_settled_in_a_fresh_transaction(
    settings: config.Settings,
    database: str,
    clock: ManualClock,
    change: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pipelined batch's rows are not locked between its submit and its collect: an app's
    change committed under the collecting step's snapshot fails its settlement with 40001, which
    is written again in a fresh fenced transaction: the leader keeps leading, each job once."""
    confirmed = testing.PipelinedMemoryAdapter("default")
    leader = make_relay(settings, {"default": confirmed}, clock, pipeline_depth=2)
    written_again = []
    write_again = leader.settler.write_again
    monkeypatch.setattr(leader.settler, "write_again", lambda *a: written_again.append(1) or write_again(*a))
    try:
        ids = stage(database, 20)
        pid = leader.leadership.pid
        app = psycopg.connect(database, autocommit=True)
        touched: list[str] = []

        def behave(job: models.StagedJob) -> testing.Behaviour:
            if not touched:  # at the collect: after the step's snapshot, before its settlement
                touched.append(str(job.job_id))
                app.execute(change, [job.job_id])
            return "ack"

        confirmed.behaviour = behave
        try:
            leader.drain_step()  # submitted, in flight
            assert leader.in_flight == 20 and not touched
            leader.metrics.tick()
            leader.turn()  # collects: the change commits under its snapshot
        finally:
            app.close()
        assert touched and written_again == [1]  # the 40001 path
        assert leader.leadership.is_leader and leader.leadership.pid == pid
        published = collections.Counter(str(job.job_id) for job in confirmed.published)
        assert sorted(published) == sorted(ids) and max(published.values()) == 1
        assert rows(database) == [] and rows(database, "staged_jobs_dead") == []
    finally:
        leader.shutdown()


def test_one_row_an_adapter_chokes_on_is_that_rows_rejection(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    ids = stage(database, 10)
    memory.behaviour = lambda job: "raise" if str(job.job_id) == ids[3] else "ack"
    report = leader.drain_once()
    assert (report.selected, report.published, report.rejected, report.skipped) == (10, 9, 1, 0)
    (left,) = rows(database)
    assert str(left["job_id"]) == ids[3] and left["attempts"] == 1
    assert str(left["last_error"]).startswith("default: ValueError: memory: cannot encode job")
    # The three before it were handed over before the batch failed, and again one by one: at least once.
    assert {str(job.job_id) for job in memory.published} == set(ids[:3] + ids[4:])
    assert leader.metrics.registry.get_sample_value("drain_backend_up", {"backend": "default"}) == 1


def test_every_row_raising_while_the_backend_answers_its_ping_rejects_them(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    stage(database, 3)
    memory.behaviour = lambda job: "raise"
    report = leader.drain_once()
    assert (report.rejected, report.skipped) == (3, 0)
    assert [row["attempts"] for row in rows(database)] == [1, 1, 1]


def test_every_row_raising_and_a_failed_ping_is_an_outage_not_a_rejection(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str, clock: ManualClock
) -> None:
    stage(database, 3)
    memory.behaviour = lambda job: "raise"
    memory.ping_fails = True
    report = leader.drain_once()
    assert (report.rejected, report.skipped) == (0, 3)
    assert [row["attempts"] for row in rows(database)] == [0, 0, 0]
    assert leader.metrics.registry.get_sample_value("drain_backend_up", {"backend": "default"}) == 0
    memory.behaviour, memory.ping_fails = (lambda job: "ack"), False
    clock.advance(3600)
    steps_until(leader.drain_once, lambda report: not report.selected, "draining")
    assert rows(database) == [] and len(memory.published) == 3


def test_a_pipelined_batch_is_collected_within_its_age_bound_while_other_batches_stay_full(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    confirmed = testing.PipelinedMemoryAdapter("confirmed")
    plain = testing.MemoryAdapter("plain")
    the_relay = make_relay(settings, {"confirmed": confirmed, "plain": plain}, clock, pipeline_depth=4)
    try:
        stage(database, 100, backend="confirmed")
        stage(database, 1000, backend="plain")
        the_relay.drain_step()  # a full batch of "confirmed": submitted, in flight
        for _ in range(4):  # full batches of "plain" only: nothing new in flight
            assert the_relay.drain_step().full
        assert the_relay.in_flight == 100 and confirmed.published == []
        clock.advance(forward.MAX_AGE_S + 0.1)
        the_relay.drain_step()
        assert the_relay.in_flight == 0 and len(confirmed.published) == 100
    finally:
        the_relay.shutdown()
