"""Whether the *table* refuses a settlement, or only some rows, in-process against a real
Postgres with the in-memory backend, every publish counted:

- a row refused with any error (a trigger raising 42501, 55P03 or 40001 for it, a row-level
  security policy refusing its burial) never keeps the drain from leading nor blocks the rest;
  the probe tests the table with a row of its own, or, without INSERT, the due rows one by one;
- any number of refused rows at the head, or in a burst mid-run, are parked and the rest flows;
- row-level security that applies to the drain's role is said (check, status, the leader's log),
  and a row of its own its SELECT does not see keeps it from leading;
- an archive rule (DO ALSO on DELETE) does not stop burials;
- a job an app staged for the parked date is not taken for a parked row;
- a retried settlement waits for a lock no longer than the time settle_timeout_s leaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import pathlib
import re
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import psycopg
import pytest

import drain
from drain import cli, config, errors, testing
from drain.relay import leadership
from drain.relay import loop as relay
from drain.store import session as store
from drain.store import writes
from tests.conftest import ManualClock
from tests.relay.test_settlement_refusals import (
    RAISING_TRIGGER,
    counts,
    execute,
    gauge,
    parked,
    remaining,
    scalar,
    status,
)
from tests.support import roles
from tests.support.waiting import steps_until

SETTLEMENT_FAILURES = pathlib.Path(__file__).resolve().parents[2] / "docs" / "drain-process.md"
SETTLE_TIMEOUT_S = 5.0
POISON = """
CREATE FUNCTION guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.job_name = 'app.poison' THEN
        RAISE EXCEPTION 'tenant policy: cannot delete job %', OLD.job_id USING ERRCODE = '{code}';
    END IF;
    RETURN OLD;
END $$;
CREATE TRIGGER guard BEFORE DELETE ON staged_jobs FOR EACH ROW EXECUTE FUNCTION guard();
"""
PASSING = {"lock_not_available", "serialization_failure"}  # held and tried again, not parked
REFERENCED = """
CREATE TABLE email_log (job_id uuid REFERENCES staged_jobs (job_id) ON DELETE RESTRICT);
INSERT INTO email_log SELECT job_id FROM staged_jobs WHERE job_name = 'app.send_email';
"""
DEAD_LETTER_POLICY = """
ALTER TABLE staged_jobs_dead ENABLE ROW LEVEL SECURITY;
CREATE POLICY dead_read ON staged_jobs_dead FOR SELECT USING (true);
CREATE POLICY dead_delete ON staged_jobs_dead FOR DELETE USING (true);
CREATE POLICY no_pii ON staged_jobs_dead FOR INSERT WITH CHECK (queue <> 'pii');
"""


def stage(dsn: str, count: int, name: str = "app.t", **options: Any) -> list[str]:
    with psycopg.connect(dsn) as conn:
        jobs = [drain.Job(name, args=[n], **options) for n in range(count)]
        return [str(job_id) for job_id in drain.stage_many(conn, jobs)]


def drain_role(database: str, *, insert: bool = False) -> contextlib.AbstractContextManager[str]:
    return roles.drain_role(database, insert=insert, prefix="drain_isolation")


@pytest.fixture(params=["own_row", "due_rows"])
def drain_dsn(request: pytest.FixtureRequest, database: str) -> Iterator[str]:
    """The drain's DSN: a role that may write a row of its own (INSERT), or one that may not
    (the documented grants: the probe falls back to the due rows)."""
    with drain_role(database, insert=request.param == "own_row") as dsn:
        yield dsn


def make_relay(
    settings: config.Settings,
    dsn: str,
    memory: testing.MemoryAdapter,
    clock: ManualClock,
    *,
    max_attempts: int = 3,
    **changes: Any,
) -> relay.Relay:
    """A relay that has not tried to lead yet."""
    settings = dataclasses.replace(
        settings,
        dsn=dsn,
        settle_timeout_s=SETTLE_TIMEOUT_S,
        backends={"default": config.BackendSettings("default", "memory", max_attempts, {})},
        **{"batch_size": 100, **changes},
    )
    return relay.Relay(settings, {"default": memory}, clock=clock, jitter=lambda: 0.0)


def run_until(the_relay: relay.Relay, clock: ManualClock, done: Callable[[], bool], what: str) -> None:
    """Go round the loop, the clock moved by each wait, until ``done()``; never CannotSettle."""

    def turn() -> None:
        clock.advance(the_relay.turn())

    steps_until(turn, lambda _: done(), what, 200)


# --- F1: a row refused with any error ---------------------------------------------------------


@pytest.mark.parametrize(
    "code", ["P0001", "insufficient_privilege", "lock_not_available", "serialization_failure"]
)
def test_a_row_refused_with_any_error_never_keeps_the_drain_from_leading(
    code: str, settings: config.Settings, database: str, drain_dsn: str, clock: ManualClock
) -> None:
    [poison] = stage(database, 1, "app.poison")
    others = stage(database, 20)
    execute(database, POISON.replace("{code}", code))
    memory = testing.MemoryAdapter("default")
    fresh = make_relay(settings, drain_dsn, memory, clock)
    try:
        run_until(fresh, clock, lambda: remaining(database) == 1, "the 20 others delivered")
        assert fresh.leadership.is_leader and not fresh.settler.held.failing
        assert set(counts(memory)) == {poison, *others} and max(counts(memory).values()) == 1
        if code in PASSING:  # may pass when written again: held by the process, not parked
            assert parked(database) == [] and fresh.settler.held.refused_ids()
        else:
            [(job_id, error)] = parked(database)
            assert job_id == poison and "tenant policy" in error, error
        later = stage(database, 5)
    finally:
        fresh.shutdown()
    again = make_relay(settings, drain_dsn, memory, clock)  # a restarted drain
    try:
        run_until(again, clock, lambda: set(later) <= set(counts(memory)), "the later jobs delivered")
    finally:
        again.shutdown()
    assert remaining(database) == 1
    assert counts(memory)[poison] == (2 if code in PASSING else 1)  # a held row goes once more


def test_row_level_security_refusing_one_burial_neither_stops_nor_blocks_the_drain(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    with drain_role(database) as dsn:
        execute(database, DEAD_LETTER_POLICY)
        [pii] = stage(database, 1, queue="pii")  # the broker takes it: nothing to bury
        first = stage(database, 20)
        memory = testing.MemoryAdapter("default")
        the_relay = make_relay(settings, dsn, memory, clock, max_attempts=1)
        try:
            run_until(the_relay, clock, lambda: remaining(database) == 0, "a fresh drain leads")
            memory.behaviour = lambda job: "reject" if job.queue == "pii" else "ack"
            [refused] = stage(database, 1, queue="pii")  # rejected at its last attempt
            later = stage(database, 20)
            run_until(the_relay, clock, lambda: remaining(database) == 1, "the 20 others delivered")
            assert not the_relay.settler.held.failing
            [(job_id, error)] = parked(database)
            assert job_id == refused and "row-level security" in error and "burial" in error, error
            assert gauge(the_relay, "drain_jobs_dead_lettered_total", backend="default", queue="pii") == 0
        finally:
            the_relay.shutdown()
    assert (
        set(counts(memory)) == {pii, *first, *later} and max(counts(memory).values()) == 1
    )  # rejected: not published
    assert scalar(database, "SELECT count(*) FROM staged_jobs_dead") == 0


def test_the_probe_names_the_write_that_failed_whatever_the_error(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    stage(database, 5)
    execute(
        database,
        """
        CREATE FUNCTION no_dead() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'no dead letters' USING ERRCODE = 'insufficient_privilege'; END $$;
        CREATE TRIGGER no_dead BEFORE INSERT ON staged_jobs_dead FOR EACH ROW EXECUTE FUNCTION no_dead();
        """,
    )
    memory = testing.MemoryAdapter("default")
    fresh = make_relay(settings, database, memory, clock)
    try:
        fresh.turn()
        blocker = fresh.leadership.blocker
        assert not fresh.leadership.is_leader and memory.published == []
        assert blocker is not None and blocker.reason == leadership.BURY_FAILS, blocker
        assert blocker.detail.startswith("a test burial") and "no dead letters" in blocker.detail
    finally:
        fresh.shutdown()


# --- F2: any number of refused rows ---------------------------------------------------------


def test_more_refused_rows_at_the_head_than_a_batch_never_stop_the_drain(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    referenced = stage(database, 25, "app.send_email")
    others = stage(database, 10)
    execute(database, REFERENCED)
    memory = testing.MemoryAdapter("default")
    with drain_role(database, insert=True) as dsn:
        fresh = make_relay(settings, dsn, memory, clock, batch_size=10)
        try:
            run_until(fresh, clock, lambda: remaining(database) == len(parked(database)), "all settled")
            assert fresh.leadership.is_leader and not fresh.settler.held.failing
        finally:
            fresh.shutdown()
    assert sorted(job for job, _ in parked(database)) == sorted(referenced)
    assert set(counts(memory)) == {*referenced, *others} and max(counts(memory).values()) == 1


def test_a_burst_of_refused_rows_mid_run_is_parked_and_the_rest_flows(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    memory = testing.MemoryAdapter("default")
    leader = make_relay(settings, database, memory, clock, batch_size=10)
    try:
        stage(database, 5)
        run_until(leader, clock, lambda: remaining(database) == 0, "leading")
        with psycopg.connect(database) as conn:  # one app transaction stages and references them
            jobs = [drain.Job("app.send_email", args=[n]) for n in range(31)]
            burst = [str(job_id) for job_id in drain.stage_many(conn, jobs)]
            conn.execute(
                "CREATE TABLE email_log (job_id uuid REFERENCES staged_jobs (job_id) ON DELETE RESTRICT)"
            )
            conn.execute("INSERT INTO email_log SELECT unnest(%s::uuid[])", [burst])
        later = stage(database, 20)
        for _ in range(40):
            clock.advance(leader.turn())
            assert not leader.settler.held.failing, "the burst was taken for the table refusing every row"
        assert remaining(database) == 31 and sorted(job for job, _ in parked(database)) == sorted(burst)
    finally:
        leader.shutdown()
    assert set(later) <= set(counts(memory)) and max(counts(memory).values()) == 1


def test_without_insert_more_refused_rows_at_the_head_than_twenty_still_lead(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    referenced = stage(database, 30, "app.send_email")
    stage(database, 10)
    execute(database, REFERENCED)
    memory = testing.MemoryAdapter("default")
    with drain_role(database) as dsn:  # no row of its own: the due rows, each alone
        fresh = make_relay(settings, dsn, memory, clock)
        try:
            run_until(fresh, clock, lambda: remaining(database) == 30, "the others delivered")
            assert fresh.leadership.is_leader and not fresh.settler.held.failing
        finally:
            fresh.shutdown()
    assert sorted(job for job, _ in parked(database)) == sorted(referenced)


def test_a_held_row_does_not_make_the_idle_leader_spin(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    stage(database, 1, "app.poison")
    stage(database, 3)
    execute(database, POISON.replace("{code}", "lock_not_available"))
    memory = testing.MemoryAdapter("default")
    leader = make_relay(settings, database, memory, clock)
    try:
        run_until(leader, clock, lambda: remaining(database) == 1 and bool(leader.settler.held), "held")
        waits = [leader.turn() for _ in range(5)]
    finally:
        leader.shutdown()
    assert min(waits) > 0, f"the idle leader spun: {waits}"


# --- F4: row-level security for the drain's role -------------------------------------------


def write_config(tmp_path: pathlib.Path, dsn: str) -> pathlib.Path:
    path = tmp_path / "drain.toml"
    path.write_text(f'dsn = "{dsn}"\n[backends.default]\ntype = "memory"\n')
    return path


def test_row_level_security_that_hides_rows_from_the_drain_is_said(
    settings: config.Settings,
    database: str,
    clock: ManualClock,
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    execute(database, "ALTER TABLE staged_jobs ENABLE ROW LEVEL SECURITY")  # no policy for the drain
    stage(database, 3)  # as the owner: the drain sees none of them
    with drain_role(database) as dsn:
        err = io.StringIO()
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            code = cli.main(["check", "--config", str(write_config(tmp_path, dsn))], env={})
        assert code == cli.EXIT_CHECK_FAILED, err.getvalue()
        assert "row-level security applies to role" in err.getvalue()
        report = status(dsn)
        assert report["backlog"] == 0 and report["can_lead"] is True
        [warning] = report["warnings"]  # type: ignore[misc]
        assert "row-level security" in warning
        memory = testing.MemoryAdapter("default")
        the_relay = make_relay(settings, dsn, memory, clock)
        try:
            with caplog.at_level(logging.WARNING, logger="drain.relay.loop"):
                the_relay.turn()
            assert the_relay.leadership.is_leader
            assert any("row-level security" in r.getMessage() for r in caplog.records)
        finally:
            the_relay.shutdown()


def test_a_row_of_its_own_its_select_does_not_see_keeps_the_drain_from_leading(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    stage(database, 3)
    with drain_role(database, insert=True) as dsn:
        role = re.search(r"postgresql://([^@]+)@", dsn)
        assert role is not None
        execute(
            database,
            "ALTER TABLE staged_jobs ENABLE ROW LEVEL SECURITY; "
            f"CREATE POLICY stage_only ON staged_jobs FOR INSERT TO {role[1]} WITH CHECK (true)",
        )
        memory = testing.MemoryAdapter("default")
        fresh = make_relay(settings, dsn, memory, clock)
        try:
            fresh.turn()
            blocker = fresh.leadership.blocker
            assert not fresh.leadership.is_leader
            assert blocker is not None and blocker.reason == leadership.SELECT_FAILS, blocker
            assert "row-level security" in blocker.detail
        finally:
            fresh.shutdown()


# --- F5: an archive rule ----------------------------------------------------------------------


def test_an_archive_rule_on_delete_neither_stops_the_drain_nor_a_burial(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    execute(
        database,
        "CREATE TABLE jobs_archive (LIKE staged_jobs); "
        "CREATE RULE archive AS ON DELETE TO staged_jobs DO ALSO INSERT INTO jobs_archive SELECT OLD.*",
    )
    ids = stage(database, 10)
    execute(database, f"UPDATE staged_jobs SET attempts = 2 WHERE job_id = '{ids[3]}'")
    memory = testing.MemoryAdapter("default")
    memory.behaviour = lambda job: "reject" if str(job.job_id) == ids[3] else "ack"
    fresh = make_relay(settings, database, memory, clock)
    try:
        run_until(fresh, clock, lambda: remaining(database) == 0, "all settled")
        assert fresh.leadership.blocker is None and not fresh.settler.held.failing
    finally:
        fresh.shutdown()
    assert scalar(database, "SELECT job_id::text FROM staged_jobs_dead") == ids[3]
    assert scalar(database, "SELECT count(*) FROM jobs_archive") == 10


# --- F6: the parked marker ----------------------------------------------------------------------


def readme_cleanup() -> str:
    """The docs' statement that deletes parked rows (docs/drain-process.md, Settlement failures)."""
    text = SETTLEMENT_FAILURES.read_text()
    found = re.search(r"`(DELETE FROM\s+staged_jobs\s+WHERE\s+run_at\s*=[^`]+)`", text)
    assert found is not None, "the docs' cleanup of parked rows"
    return " ".join(found[1].split())


def test_a_job_staged_for_the_parked_date_is_neither_counted_nor_cleaned_up_as_parked(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    [sentinel] = stage(database, 1, run_at=writes.PARKED_AT)  # an app's "far future" job
    [refused] = stage(database, 1, "app.send_email")
    stage(database, 3)
    execute(database, REFERENCED)
    memory = testing.MemoryAdapter("default")
    leader = make_relay(settings, database, memory, clock)
    try:
        run_until(leader, clock, lambda: remaining(database) == 2, "the rest delivered")
    finally:
        leader.shutdown()
    assert status(database)["parked"] == 1
    execute(database, "DELETE FROM email_log")
    execute(database, readme_cleanup())
    assert scalar(database, "SELECT job_id::text FROM staged_jobs") == sentinel
    assert refused in counts(memory) and sentinel not in counts(memory)


# --- F7: lock waits of a retried settlement -----------------------------------------------------


def test_a_retried_settlement_waits_for_a_lock_no_longer_than_the_time_left(
    settings: config.Settings, database: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[int] = []
    delete = store.Batch._delete_statement

    def watched(batch: store.Batch, keys: Any) -> Any:  # the lock wait in force at each DELETE
        row = batch._conn.execute("SELECT setting FROM pg_settings WHERE name = 'lock_timeout'").fetchone()
        waits.append(int(row[0]) if row else -1)
        return delete(batch, keys)

    memory = testing.MemoryAdapter("default")
    leader = make_relay(settings, database, memory, clock)
    try:
        assert leader.leadership.try_acquire()
        stage(database, 5)
        execute(database, RAISING_TRIGGER)
        leader.turn()  # published; the settlement fails: settle_timeout_s runs from now
        assert leader.settler.held.failing
        monkeypatch.setattr(store.Batch, "_delete_statement", watched)
        clock.advance(SETTLE_TIMEOUT_S - 0.25)  # 250 ms left
        leader.turn()  # written again
        assert waits and all(0 < wait <= 250 for wait in waits), waits
        clock.advance(1.0)
        with pytest.raises(errors.CannotSettle):
            leader.turn()
    finally:
        leader.shutdown()
