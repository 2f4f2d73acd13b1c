"""Red team 39, third pass: the lanes select's fallback (SelectAgain) with batches in flight, a
lanes select that fails only sometimes, and which failures make a member give up the index.

Drains run in-process (tests/relay/test_lanes.py's helpers, a ManualClock, the in-memory
adapters as brokers); the failures are real PostgreSQL errors raised in the batch's transaction
in place of the lanes select (a cursor that runs a failing statement instead)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any

import psycopg
import pytest

from drain import config, testing
from drain.relay import lanes as lanes_mod
from drain.store import sql
from tests.conftest import ManualClock
from tests.relay.test_lanes import LANES, drains, remaining, rounds, stage
from tests.support import lanes as lanes_support

NAMES = sql.Names("public", "staged_jobs")


def _build(dsn: str) -> None:
    lanes_support.build_lanes_index(dsn, LANES)


class _Faults:
    """Which lanes selects fail, and with which SQLSTATE (a DO block raising it, in the batch's
    transaction: the transaction is aborted as by the real failure)."""

    def __init__(self, sqlstate: str, fail: Any) -> None:
        self.sqlstate, self.fail = sqlstate, fail
        self.lanes_selects = 0
        self.failed = 0


def _faulty_cursor(monkeypatch: pytest.MonkeyPatch, faults: _Faults) -> None:
    raw = psycopg.RawCursor
    function = "staged_jobs_lanes"

    class Faulty(raw):  # type: ignore[misc,valid-type]
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            text = query if isinstance(query, str) else str(query)
            if function in text:
                faults.lanes_selects += 1
                if faults.fail(faults.lanes_selects):
                    faults.failed += 1
                    return super().execute(
                        f"DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '{faults.sqlstate}'; END $$"
                    )
            return super().execute(query, params, **kwargs)

    monkeypatch.setattr(psycopg, "RawCursor", Faulty)


def stage_more(dsn: str) -> None:
    """1,000 more rows, numbered 10,000 on, on the same 97 keys."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (job_name, job_args, ordering_key) "
            "SELECT 'job', jsonb_build_array(10000 + i), 'k' || (i % 97) FROM generate_series(0, 999) AS i"
        )


def _key_order(published: list[Any]) -> list[str]:
    by_key: dict[str | None, list[int]] = {}
    for job in published:
        by_key.setdefault(job.ordering_key, []).append(job.args[0])
    return [str(k) for k, seen in by_key.items() if seen != sorted(seen)]


def test_redteam39c_intermittent_lanes_failures_with_batches_in_flight_lose_and_reorder_nothing(
    settings: config.Settings,
    database: str,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Four members (2 of 8 lanes each, through the index), a pipelined broker (pipeline_depth 4:
    confirms collected steps later), 6,000 rows on 97 keys. One lanes select in 5 fails with a
    data error (22012) while batches are in flight; every 10 rounds `drain migrate` replaces the
    function (a new version: the members come back to the index, and fail again). Expected: every
    row published, per-key order kept, no step-down, members back on the index after each
    migrate. Counted: committed, sent, collected, duplicates, lost."""
    _build(database)
    faults = _Faults("22012", lambda n: n % 5 == 0)
    _faulty_cursor(monkeypatch, faults)
    stage(database, 6_000, keys=97)
    piped = dataclasses.replace(settings, pipeline_depth=4)
    broker = testing.PipelinedMemoryAdapter()
    relays = [r for r, _ in drains(piped, 4, clock, adapter=broker)]
    back_on_index: list[int] = []
    tried_after_migrate: list[int] = []
    try:
        with caplog.at_level(logging.WARNING):
            rounds(relays, clock, int(lanes_mod.INDEX_LOOK_EVERY_S) + 1)
            for n in itertools.count():
                if remaining(database) == 0 or n > 400:
                    break
                if n % 10 == 0:
                    before = faults.lanes_selects
                    _build(database)
                    rounds(relays, clock, int(lanes_mod.INDEX_LOOK_EVERY_S) + 1)
                    tried_after_migrate.append(faults.lanes_selects - before)
                rounds(relays, clock, 1)
            # the failures stop; one more migrate: every member back on the index, idle or not
            faults.fail = lambda n: False
            _build(database)
            rounds(relays, clock, int(lanes_mod.INDEX_LOOK_EVERY_S) + 1)
            back_on_index.append(sum(r.store.reader.indexed_lanes() is not None for r in relays))
            stage_more(database)
            before = faults.lanes_selects
            for _ in range(200):
                if remaining(database) == 0:
                    break
                rounds(relays, clock, 1)
            back_on_index.append(sum(r.store.reader.indexed_lanes() is not None for r in relays))
            tried_after_migrate.append(faults.lanes_selects - before)
    finally:
        for each in relays:
            each.shutdown()
    sent = [job.args[0] for batch in broker.submitted for job in batch]
    published = [job.args[0] for job in broker.published]
    lost = sorted((set(range(6_000)) | set(range(10_000, 11_000))) - set(published))
    step_downs = [r for r in caplog.records if getattr(r, "event", None) == "lost_leadership"]
    disorder = _key_order(broker.published)
    print(
        f"lanes selects {faults.lanes_selects}, failed {faults.failed}; committed 6000, sent {len(sent)} "
        f"(duplicates {len(sent) - len(set(sent))}), collected {len(published)} "
        f"(duplicates {len(published) - len(set(published))}), lost {len(lost)}, left {remaining(database)}; "
        f"step-downs {len(step_downs)}; keys out of order {len(disorder)}; members on the index after "
        f"the last migrate (idle, after more rows) {back_on_index}; lanes selects after each migrate "
        f"{tried_after_migrate}"
    )
    assert faults.failed > 0
    assert lost == [] and remaining(database) == 0
    assert disorder == []
    assert len(sent) == len(set(sent)), "duplicates sent"
    assert not step_downs
    assert back_on_index == [4, 4], back_on_index
    assert all(tried_after_migrate), tried_after_migrate


@pytest.mark.parametrize("sqlstate", ["40P01", "55P03", "57014", "53200"])
def test_redteam39c_a_transient_failure_of_the_lanes_select_does_not_abandon_the_index(
    settings: config.Settings,
    database: str,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    sqlstate: str,
) -> None:
    """One lanes select fails once with an error any select may meet (a deadlock, 40P01; a lock
    or statement timeout; out of memory), then never again. Expected: the member forwards every
    row and reads through the index again without a migrate (the function is not at fault)."""
    _build(database)
    faults = _Faults(sqlstate, lambda n: n == 3)
    _faulty_cursor(monkeypatch, faults)
    stage(database, 2_000, keys=31)
    broker = testing.MemoryAdapter()
    relays = [r for r, _ in drains(settings, 4, clock, adapter=broker)]
    try:
        with caplog.at_level(logging.WARNING):
            rounds(relays, clock, int(lanes_mod.INDEX_LOOK_EVERY_S) + 1)
            for _ in range(300):
                if remaining(database) == 0:
                    break
                rounds(relays, clock, 1)
            rounds(relays, clock, 2 * int(lanes_mod.INDEX_LOOK_EVERY_S) + 2)
            on_index = sum(r.store.reader.indexed_lanes() is not None for r in relays)
    finally:
        for each in relays:
            each.shutdown()
    published = [job.args[0] for job in broker.published]
    step_downs = [r for r in caplog.records if getattr(r, "event", None) == "lost_leadership"]
    walking = [r for r in caplog.records if getattr(r, "event", None) == "lanes_select_failed"]
    print(
        f"{sqlstate}: failed {faults.failed} of {faults.lanes_selects} lanes selects; published "
        f"{len(published)} (distinct {len(set(published))}), left {remaining(database)}; step-downs "
        f"{len(step_downs)}; 'walking until replaced' warnings {len(walking)}; members on the index "
        f"after 2 looks {on_index} of 4"
    )
    assert faults.failed == 1
    assert sorted(set(published)) == list(range(2_000)) and remaining(database) == 0
    assert _key_order(broker.published) == []
    assert on_index == 4, f"{4 - on_index} member(s) walk until the next migrate after {sqlstate}"


def test_redteam39c_a_lanes_select_timing_out_every_time_does_not_stop_the_forwarding(
    settings: config.Settings,
    database: str,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every select through the lanes index is cancelled by statement_timeout (57014: deemed
    transient, so the member does not walk); the walk would work. Four members, 2,000 rows, 300
    rounds. Expected: the rows still go (the member falls back to the walk after repeated
    failures, or at least forwards), without a step-down every turn. Counted: lanes selects,
    step-downs, rows left."""
    _build(database)
    faults = _Faults("57014", lambda n: True)
    _faulty_cursor(monkeypatch, faults)
    stage(database, 2_000, keys=31)
    broker = testing.MemoryAdapter()
    relays = [r for r, _ in drains(settings, 4, clock, adapter=broker)]
    try:
        with caplog.at_level(logging.WARNING):
            rounds(relays, clock, 300)
    finally:
        for each in relays:
            each.shutdown()
    published = [job.args[0] for job in broker.published]
    step_downs = [r for r in caplog.records if getattr(r, "event", None) == "lost_leadership"]
    print(
        f"57014 always: {faults.failed} lanes selects failed; published {len(published)} "
        f"(distinct {len(set(published))}), left {remaining(database)} of 2000; step-downs "
        f"{len(step_downs)} ({step_downs[0].getMessage() if step_downs else ''})"
    )
    assert remaining(database) == 0, f"{remaining(database)} rows left, {len(step_downs)} step-downs"
    assert len(step_downs) <= 16, (
        f"{len(step_downs)} step-downs in 1,200 turns (at most one per member a look)"
    )


def test_redteam39c_held_rows_at_a_failed_lanes_select_are_settled_once_in_key_order(
    settings: config.Settings,
    database: str,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pipelined broker (pipeline_depth 4); when a batch's confirm is collected, an app locks
    every 40th row of it (FOR UPDATE in a transaction it ends 3 rounds later): the settlement
    holds those rows (settle.Held, locked). One lanes select in 3 fails (22012, SelectAgain),
    while rows are held and batches in flight; migrate every 10 rounds. Expected: every row
    published once, per-key order kept, nothing left; rows held count > 0."""
    _build(database)
    faults = _Faults("22012", lambda n: n % 3 == 0)
    _faulty_cursor(monkeypatch, faults)
    stage(database, 4_000, keys=53)
    piped = dataclasses.replace(settings, pipeline_depth=4)
    broker = testing.PipelinedMemoryAdapter()
    locker = psycopg.connect(database)
    locked: list[int] = []

    def behaviour(job: Any) -> testing.Behaviour:
        if job.args[0] % 40 == 0 and job.args[0] not in locked:
            locker.execute("SELECT id FROM staged_jobs WHERE id = %s FOR UPDATE NOWAIT", (job.id,))
            locked.append(job.args[0])
        return "ack"

    broker.behaviour = behaviour
    relays = [r for r, _ in drains(piped, 4, clock, adapter=broker)]
    held_seen = 0
    try:
        with caplog.at_level(logging.WARNING):
            for n in range(600):
                if remaining(database) == 0:
                    break
                if n % 10 == 0:
                    _build(database)
                if n % 3 == 0:
                    locker.commit()
                rounds(relays, clock, 1)
                held_seen = max(held_seen, sum(len(r.settler.held.row_ids()) for r in relays))
            locker.commit()
            for _ in range(100):
                if remaining(database) == 0:
                    break
                rounds(relays, clock, 1)
    finally:
        locker.close()
        for each in relays:
            each.shutdown()
    sent = [job.args[0] for batch in broker.submitted for job in batch]
    published = [job.args[0] for job in broker.published]
    lost = sorted(set(range(4_000)) - set(published))
    step_downs = [r for r in caplog.records if getattr(r, "event", None) == "lost_leadership"]
    disorder = _key_order(broker.published)
    print(
        f"lanes selects {faults.lanes_selects}, failed {faults.failed}; "
        f"rows locked by the app {len(locked)}, held at most {held_seen}; "
        f"committed 4000, sent {len(sent)} (duplicates {len(sent) - len(set(sent))}), "
        f"collected {len(published)} (duplicates {len(published) - len(set(published))}), lost {len(lost)}, "
        f"left {remaining(database)}; step-downs {len(step_downs)}; keys out of order {len(disorder)}"
    )
    assert faults.failed > 0 and held_seen > 0
    assert lost == [] and remaining(database) == 0
    assert len(sent) == len(set(sent)), "duplicates sent"
    assert disorder == []


def test_redteam39c_a_lanes_select_timing_out_every_time_sends_nothing_twice_with_a_pipelined_broker(
    settings: config.Settings,
    database: str,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As the test above, with a pipelined broker (pipeline_depth 4): each step-down forgets the
    batches in flight, whose rows the next leader of their lanes sends again. Counted: sent,
    duplicates, collected, lost."""
    _build(database)
    faults = _Faults("57014", lambda n: True)
    _faulty_cursor(monkeypatch, faults)
    stage(database, 2_000, keys=31)
    broker = testing.PipelinedMemoryAdapter()
    piped = dataclasses.replace(settings, pipeline_depth=4)
    relays = [r for r, _ in drains(piped, 4, clock, adapter=broker)]
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(300):
                if remaining(database) == 0:
                    break
                rounds(relays, clock, 1)
    finally:
        for each in relays:
            each.shutdown()
    sent = [job.args[0] for batch in broker.submitted for job in batch]
    published = [job.args[0] for job in broker.published]
    lost = sorted(set(range(2_000)) - set(published))
    step_downs = [r for r in caplog.records if getattr(r, "event", None) == "lost_leadership"]
    print(
        f"57014 always, pipelined: {faults.failed} lanes selects failed; committed 2000, sent {len(sent)} "
        f"(duplicates {len(sent) - len(set(sent))}), collected {len(published)}, lost {len(lost)}, "
        f"left {remaining(database)}; step-downs {len(step_downs)}"
    )
    assert lost == [] and remaining(database) == 0
    assert len(sent) == len(set(sent)), (
        f"{len(sent) - len(set(sent))} duplicates, {len(step_downs)} step-downs"
    )
