"""Rows whose settlement *and* parking the table refuses, in-process against a real Postgres with
the in-memory backend, every publish counted (red team 26, findings 3-4):

- a row whose DELETE an app's foreign key refuses (ON DELETE RESTRICT) and whose parking an app's
  CHECK on run_at refuses is parked in place (its last_error marked, run_at untouched): published
  once across any number of drain restarts, counted as parked, neither due nor lag;
- a row whose mark is refused too is held by the process with only what its settlement needs (no
  arguments), and the rows held are capped: past the cap nothing new is published and the drain
  exits (CannotSettle) after settle_timeout_s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
from collections.abc import Iterator

import psycopg
import pytest

import drain
from drain import config, errors, testing
from drain.relay import leadership, settle
from drain.relay import loop as relay
from drain.store import writes
from tests.conftest import ManualClock
from tests.relay.test_settlement_refusals import counts, execute, gauge, remaining, scalar, status
from tests.support import roles
from tests.support.waiting import steps_until

SETTLE_TIMEOUT_S = 5.0
LIVES = 4
# Two ordinary app constraints: orders references its confirmation job (its DELETE is refused),
# and no job may be scheduled past 2100 (the parking UPDATE, run_at 9000-01-01, is refused).
# Neither touches the drain's own probe row: the probe passes.
FK_AND_CHECK = """
ALTER TABLE staged_jobs ADD CONSTRAINT run_at_sane CHECK (run_at < '2100-01-01');
CREATE TABLE orders (id serial PRIMARY KEY,
                     confirm_job uuid REFERENCES staged_jobs (job_id) ON DELETE RESTRICT);
INSERT INTO orders (confirm_job) SELECT job_id FROM staged_jobs WHERE job_name = 'orders.confirm';
"""
# And one that refuses the mark too (a last_error the app reserves): the row can only be held.
NO_MARK = """
ALTER TABLE staged_jobs ADD CONSTRAINT no_parking_note
    CHECK (coalesce(last_error, '') NOT LIKE 'drain: parked%');
"""


def stage(dsn: str, count: int, name: str = "app.job", arg: str = "") -> list[str]:
    with psycopg.connect(dsn) as conn:
        jobs = [drain.Job(name, args=[n, arg]) for n in range(count)]
        return [str(job_id) for job_id in drain.stage_many(conn, jobs)]


@contextlib.contextmanager
def dsn_for(database: str, kind: str) -> Iterator[str]:
    """The test database as a superuser (a row of its own for the probe) or as the drain's
    documented role without INSERT (the probe asks the due rows)."""
    if kind == "own_row":
        yield database
        return
    with roles.drain_role(database, prefix="drain_held") as dsn:
        yield dsn


def make_relay(
    settings: config.Settings, dsn: str, memory: testing.MemoryAdapter, clock: ManualClock
) -> relay.Relay:
    settings = dataclasses.replace(
        settings,
        dsn=dsn,
        batch_size=10,
        settle_timeout_s=SETTLE_TIMEOUT_S,
        backends={"default": config.BackendSettings("default", "memory", 3, {})},
    )
    return relay.Relay(settings, {"default": memory}, clock=clock, jitter=lambda: 0.0)


def lead_until_one_left(the_relay: relay.Relay, clock: ManualClock, database: str) -> None:
    steps_until(
        lambda: clock.advance(the_relay.turn()),
        lambda _: remaining(database) == 1 and the_relay.leadership.is_leader,
        "the rest delivered",
        200,
    )


def turns(the_relay: relay.Relay, clock: ManualClock, count: int) -> None:
    for _ in range(count):
        clock.advance(the_relay.turn())


@pytest.mark.parametrize("kind", ["own_row", "due_rows"])
def test_a_row_whose_delete_and_parking_are_refused_is_published_once_across_restarts(
    kind: str, settings: config.Settings, database: str, clock: ManualClock
) -> None:
    [confirm] = stage(database, 1, "orders.confirm")
    others = stage(database, 5)
    execute(database, FK_AND_CHECK)
    memory = testing.MemoryAdapter("default")
    with dsn_for(database, kind) as dsn:
        for life in range(LIVES):
            fresh = make_relay(settings, dsn, memory, clock)
            try:
                lead_until_one_left(fresh, clock, database)
                turns(fresh, clock, 5)  # and more turns: nothing is published again
                published = counts(memory)[confirm]
                assert published == 1, f"life {life}: orders.confirm published {published} times"
                assert not fresh.settler.held and not fresh.settler.held.failing, life  # nothing held
                if life == 0:
                    assert gauge(fresh, "drain_parked_jobs_total") == 1
                assert not fresh.store.anything_due().now  # the idle leader may sleep
            finally:
                fresh.shutdown()
    assert set(counts(memory)) == {confirm, *others} and max(counts(memory).values()) == 1
    row = psycopg.connect(database).execute("SELECT run_at, last_error FROM staged_jobs").fetchone()
    assert row is not None
    run_at, error = row
    assert run_at is None and str(error).startswith(writes.PARKED_IN_PLACE_PREFIX), error
    assert "refused its DELETE" in error and "orders" in error, error
    figures = status(database)
    assert figures["parked"] == 1 and figures["due"] == 0 and figures["oldest_due_age_s"] == 0
    # the docs' cleanup, once the app lets go of it
    execute(database, "DELETE FROM orders")
    execute(database, cleanup_in_place())
    assert remaining(database) == 0


def cleanup_in_place() -> str:
    """The docs' statement that deletes rows parked in place (docs/drain-process.md)."""
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "drain-process.md").read_text()
    found = re.search(r"`(DELETE FROM\s+staged_jobs\s+WHERE\s+last_error\s+LIKE[^`]+)`", text)
    assert found is not None, "the docs' cleanup of rows parked in place"
    return " ".join(found[1].split())


def test_rows_whose_mark_is_refused_too_are_held_without_their_content_and_capped(
    settings: config.Settings, database: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(settle, "MAX_HELD_ROWS", 25)
    refused = stage(database, 40, "orders.confirm", arg="x" * 20_000)
    execute(database, FK_AND_CHECK + NO_MARK)
    memory = testing.MemoryAdapter("default")
    fresh = make_relay(settings, database, memory, clock)
    try:
        with pytest.raises(errors.CannotSettle, match="held"):
            for _ in range(200):
                clock.advance(fresh.turn())
        held = fresh.settler.held
        # one batch past the cap at most, then nothing new: 30 of the 40 published, each once
        assert 25 <= held.jobs <= 25 + fresh.settings.batch_size, held.jobs
        assert len(memory.published) == held.jobs and max(counts(memory).values()) == 1
        jobs = held.all()
        assert jobs and all(not job.args and not job.kwargs and not job.options for job in jobs)
        assert held.bytes <= held.jobs * (settle.HELD_ROW_BYTES + 200)
        assert gauge(fresh, "drain_cannot_settle", reason=leadership.SETTLEMENT_FAILED) == 1
    finally:
        fresh.shutdown()
    assert remaining(database) == len(refused)
    assert scalar(database, "SELECT count(*) FROM staged_jobs WHERE last_error IS NOT NULL") == 0
