"""The pipelined loop (drain_step, ``pipeline_depth``) against a real Postgres, with the in-memory
pipelined backend: rows in flight are never selected twice, are deleted only once acknowledged,
and a leader that dies with batches in flight loses nothing (they go again: duplicates only)."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence

import psycopg
import pytest

import drain
from drain import config, testing
from drain.relay import loop as relay
from tests.conftest import ManualClock
from tests.support import relays
from tests.support.waiting import steps_until


@pytest.fixture
def memory() -> testing.PipelinedMemoryAdapter:
    return testing.PipelinedMemoryAdapter("default")


def make_relay(
    settings: config.Settings, memory: testing.MemoryAdapter, depth: int, clock: ManualClock | None = None
) -> relay.Relay:
    return relays.leading(settings, {"default": memory}, clock or ManualClock(), pipeline_depth=depth)


@pytest.fixture
def leader(
    settings: config.Settings, memory: testing.PipelinedMemoryAdapter, clock: ManualClock
) -> Iterator[relay.Relay]:
    the_relay = make_relay(settings, memory, depth=2, clock=clock)
    yield the_relay
    the_relay.shutdown()


def stage(dsn: str, count: int) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [str(i) for i in drain.stage_many(conn, [drain.Job("app.t", args=[n]) for n in range(count)])]


def staged(dsn: str) -> list[dict[str, object]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cursor:
        return cursor.execute("SELECT * FROM staged_jobs ORDER BY id").fetchall()


def test_full_batches_stay_in_flight_up_to_the_depth_and_are_settled_later(
    leader: relay.Relay, memory: testing.PipelinedMemoryAdapter, database: str
) -> None:
    ids = stage(database, 350)
    first = leader.drain_step()
    assert (first.selected, first.published, leader.in_flight) == (100, 0, 100)
    second = leader.drain_step()
    assert (second.selected, second.published, leader.in_flight) == (100, 0, 200)
    assert len(staged(database)) == 350  # nothing deleted before its acknowledgement is collected
    assert leader.metrics.registry.get_sample_value("drain_jobs_in_flight") == 200
    third = leader.drain_step()  # a third batch in flight would exceed depth 2: the oldest settles
    assert (third.selected, third.published, leader.in_flight) == (100, 100, 200)
    assert len(staged(database)) == 250
    partial = leader.drain_step()  # partial: in flight as well; the oldest beyond depth 2 settles
    assert (partial.selected, partial.published, leader.in_flight) == (50, 100, 150)
    assert len(staged(database)) == 150
    last = leader.drain_step()  # nothing new: everything in flight settles
    assert (last.selected, last.published, leader.in_flight) == (0, 150, 0)
    assert staged(database) == []
    assert [str(job.job_id) for job in memory.published] == ids  # each once, in id order
    assert memory.outstanding == 0
    assert leader.metrics.registry.get_sample_value("drain_jobs_in_flight") == 0


def test_failures_collected_later_are_recorded_by_that_step(
    leader: relay.Relay, memory: testing.PipelinedMemoryAdapter, database: str
) -> None:
    stage(database, 200)
    leader.drain_step()
    memory.behaviour = lambda job: "reject" if job.args[0] % 2 else "retry"
    leader.drain_step()
    report = leader.settle_in_flight()
    assert (report.rejected, report.retried, report.published) == (100, 100, 0)
    rows = staged(database)
    assert len(rows) == 200
    assert collections.Counter(row["attempts"] for row in rows) == {1: 100, 0: 100}
    assert all(row["run_at"] is not None and row["last_error"] for row in rows)


def test_a_backend_down_at_collect_time_touches_nothing_and_drops_later_batches(
    leader: relay.Relay, memory: testing.PipelinedMemoryAdapter, database: str, clock: ManualClock
) -> None:
    stage(database, 300)
    leader.drain_step()
    leader.drain_step()
    memory.down = True
    report = leader.drain_step()  # collects the oldest: unavailable; the backend is paused
    assert report.published == 0 and report.skipped >= 100
    assert leader.in_flight == 0
    rows = staged(database)
    assert len(rows) == 300 and all(row["attempts"] == 0 and row["run_at"] is None for row in rows)
    memory.down = False
    clock.advance(3600)  # the pause is over
    steps_until(leader.drain_step, lambda r: not r.selected and not leader.in_flight, "draining")
    assert staged(database) == []
    assert len({job.id for job in memory.published}) == 300


class CountingAdapter(testing.PipelinedMemoryAdapter):
    """Counts every call the relay makes into it (an unavailable open counts too)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.calls: collections.Counter[str] = collections.Counter()

    def open(self) -> None:
        self.calls["open"] += 1
        super().open()

    def collect(self, ticket: list[drain.StagedJob], /) -> list[drain.PublishResult]:
        self.calls["collect"] += 1
        return super().collect(ticket)


def test_a_backend_that_failed_in_a_step_is_not_called_again_in_that_step(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """Each call into a failed backend may wait a whole timeout (a reconnect to a dark broker):
    after the first failure the backend is not opened again in the step, and its other batches
    in flight are only collected for what they already hold (closed, it waits for nothing)."""
    counting = CountingAdapter("default")
    the_relay = make_relay(settings, counting, depth=4, clock=clock)
    try:
        stage(database, 300)
        for _ in range(3):
            the_relay.drain_step()
        assert the_relay.in_flight == 300
        counting.down = True
        counting.calls.clear()
        report = the_relay.settle_in_flight()  # three batches due; the first one fails
        assert counting.calls == {"collect": 3}, "a failed backend was opened again in the same step"
        assert (report.published, report.skipped, the_relay.in_flight) == (0, 300, 0)
        rows = staged(database)
        assert len(rows) == 300 and all(row["attempts"] == 0 and row["run_at"] is None for row in rows)
        counting.down = False
        clock.advance(3600)  # the pause is over
        steps_until(the_relay.drain_step, lambda r: not r.selected and not the_relay.in_flight, "draining")
        assert staged(database) == []
    finally:
        the_relay.shutdown()


class ConfirmingAdapter(testing.PipelinedMemoryAdapter):
    """Confirms each batch as it takes it, as a broker does while the relay reads the next rows;
    ``collect`` hands back those results, but for the tickets in ``lost``: their connection
    closed before their confirms came, so nothing of them is known (BackendUnavailable)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.lost: list[object] = []

    def submit(self, jobs: Sequence[drain.StagedJob], /) -> list[drain.StagedJob]:
        self.published.extend(jobs)
        return super().submit(jobs)

    def collect(self, ticket: list[drain.StagedJob], /) -> list[drain.PublishResult]:
        self.outstanding -= 1
        if any(ticket is lost for lost in self.lost):
            raise drain.BackendUnavailable("connection closed: CONNECTION_FORCED")
        return [drain.PublishResult.published(job) for job in ticket]


def test_batches_confirmed_before_their_backend_failed_are_settled_not_published_again(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """Issue 33, item 4: the broker closed the drain's connection under load, and jobs it had
    confirmed were delivered twice. The oldest batch in flight had lost its connection before
    any confirm came; collecting it failed the backend, and the relay dropped the backend's
    other batches in flight with their confirms: their rows were selected and published again.
    A failed backend's batches are collected for what they hold: only the lost batch goes again."""
    confirming = ConfirmingAdapter("default")
    the_relay = make_relay(settings, confirming, depth=4, clock=clock)
    try:
        ids = stage(database, 500)
        for _ in range(4):
            the_relay.drain_step()
        assert the_relay.in_flight == 400
        confirming.lost.append(confirming.submitted[0])
        # The fifth batch goes out, then the oldest is due: it fails the backend, and the four
        # others (not due yet) hold their confirms.
        report = the_relay.drain_step()
        assert (report.published, report.skipped, the_relay.in_flight) == (400, 100, 0)
        assert len(staged(database)) == 100
        confirming.lost.clear()
        clock.advance(3600)  # the pause is over
        steps_until(the_relay.drain_step, lambda r: not r.selected and not the_relay.in_flight, "draining")
        assert staged(database) == []
        copies = collections.Counter(str(job.job_id) for job in confirming.published)
        assert set(copies) == set(ids)
        twice = {job_id for job_id, n in copies.items() if n > 1}
        assert twice == set(ids[:100]), "only the lost batch again"
    finally:
        the_relay.shutdown()


class BlockedAdapter(testing.PipelinedMemoryAdapter):
    """Opens and takes every submit, as a broker under a resource alarm does; never confirms."""

    def collect(self, ticket: list[drain.StagedJob], /) -> list[drain.PublishResult]:
        raise drain.BackendUnavailable("the broker blocks publishing (resource alarm)")


def test_a_backend_that_takes_batches_but_never_confirms_backs_off_longer_each_time(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """A blocked broker accepts the bytes of a submit and never confirms: a submit is no
    answer, so the pause keeps growing instead of restarting at every retry."""
    the_relay = make_relay(settings, BlockedAdapter("default"), depth=4, clock=clock)
    try:
        stage(database, 50)
        for expected in (1, 2, 3):
            assert the_relay.drain_step().selected == 50
            the_relay.settle_in_flight()
            assert the_relay.forwarder.pause_streak("default") == expected
            up = the_relay.metrics.registry.get_sample_value("drain_backend_up", {"backend": "default"})
            assert up == 0
            clock.advance(3600)  # the pause is over: the next step tries again
        rows = staged(database)
        assert len(rows) == 50 and all(row["attempts"] == 0 for row in rows)
    finally:
        the_relay.shutdown()


def test_shutdown_settles_the_batches_in_flight(
    settings: config.Settings, memory: testing.PipelinedMemoryAdapter, database: str
) -> None:
    stage(database, 250)
    the_relay = make_relay(settings, memory, depth=4)
    the_relay.drain_step()
    the_relay.drain_step()
    assert the_relay.in_flight == 200
    the_relay.shutdown()
    assert len(staged(database)) == 50
    assert len(memory.published) == 200 and memory.outstanding == 0


def test_drain_once_settles_what_a_step_left_in_flight(
    leader: relay.Relay, memory: testing.PipelinedMemoryAdapter, database: str
) -> None:
    stage(database, 250)
    leader.drain_step()
    report = leader.drain_once()
    assert (report.selected, report.published, leader.in_flight) == (100, 200, 0)
    assert len(staged(database)) == 50


def test_a_leader_that_dies_with_batches_in_flight_loses_nothing(
    settings: config.Settings, memory: testing.PipelinedMemoryAdapter, database: str
) -> None:
    ids = set(stage(database, 300))
    first = make_relay(settings, memory, depth=4)
    first.drain_step()
    first.drain_step()
    assert first.in_flight == 200
    die_and_forward_again(first, settings, memory, database, ids)  # the 200 in flight go again


def die_and_forward_again(
    first: relay.Relay,
    settings: config.Settings,
    memory: testing.PipelinedMemoryAdapter,
    database: str,
    ids: set[str],
) -> None:
    """``first``'s session dies with batches in flight: the lock goes, nothing in flight was
    deleted, and a new leader forwards every one of ``ids`` (those in flight again)."""
    first.store.close()
    assert len(staged(database)) == len(ids)
    memory.submitted.clear()
    second = make_relay(settings, memory, depth=4)
    try:
        steps_until(second.drain_step, lambda r: not r.selected and not second.in_flight, "draining")
    finally:
        second.shutdown()
    assert staged(database) == []
    assert {str(job.job_id) for job in memory.published} == ids


def test_depth_zero_is_one_whole_batch_per_transaction(
    settings: config.Settings, memory: testing.PipelinedMemoryAdapter, database: str
) -> None:
    stage(database, 150)
    the_relay = make_relay(settings, memory, depth=0)
    try:
        report = the_relay.drain_step()
        assert (report.selected, report.published, the_relay.in_flight) == (100, 100, 0)
        assert len(staged(database)) == 50
    finally:
        the_relay.shutdown()


def test_a_leader_that_dies_with_partial_batches_in_flight_loses_nothing(
    settings: config.Settings, memory: testing.PipelinedMemoryAdapter, database: str
) -> None:
    """Partial batches are pipelined too: the rows of two small steps are in flight, unsettled,
    when the session dies; the next leader forwards them again (duplicates only)."""
    first = make_relay(settings, memory, depth=4)
    ids = set(stage(database, 30))
    assert first.drain_step().selected == 30
    ids |= set(stage(database, 20))
    assert first.drain_step().selected == 20
    assert first.in_flight == 50
    die_and_forward_again(first, settings, memory, database, ids)  # the 50 in flight go again
