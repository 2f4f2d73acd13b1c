"""What a settlement does when the table refuses it, in-process against a real Postgres with the
in-memory backend, every publish counted:

- a DELETE that skips rows without an error (a BEFORE DELETE trigger returning NULL, a rule DO
  INSTEAD NOTHING, a row-level security policy) is a settlement failure, not a storm, and the
  probe finds it before the drain leads;
- the probe tries every kind of settlement write (the retry UPDATE, the burial), and one failing
  part of a settlement does not roll back the others;
- a settlement matches (id, job_id): an id reused between publish and settle is not deleted;
- one row the table refuses (a foreign key to its job_id, a trigger for that row) is parked, and
  the rest flow: each row published at most twice, none lost; a row refused alone is parked at
  once when a row of the drain's own shows the table takes the write, else when another due row
  does;
- a persistent failure ends the loop within a step of ``settle_timeout_s``, not a backoff later.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import uuid
from collections.abc import Iterator
from contextlib import redirect_stdout

import psycopg
import pytest

import drain
from drain import cli, config, errors, testing
from drain.relay import leadership
from drain.relay import loop as relay
from drain.store import writes
from tests.conftest import ManualClock
from tests.support import relays, roles
from tests.support.waiting import steps_until

SETTLE_TIMEOUT_S = 5.0
SKIPS = {
    "trigger": """
        CREATE FUNCTION skip_delete() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
        CREATE TRIGGER skip_delete BEFORE DELETE ON staged_jobs FOR EACH ROW EXECUTE FUNCTION skip_delete();
    """,
    "rule": "CREATE RULE skip_delete AS ON DELETE TO staged_jobs DO INSTEAD NOTHING",
    "rls": """
        ALTER TABLE staged_jobs ENABLE ROW LEVEL SECURITY;
        CREATE POLICY readable ON staged_jobs FOR SELECT USING (true);
        CREATE POLICY updatable ON staged_jobs FOR UPDATE USING (true);
    """,
}
HEAL_SKIPS = {
    "trigger": "DROP TRIGGER skip_delete ON staged_jobs",
    "rule": "DROP RULE skip_delete ON staged_jobs",
    "rls": "ALTER TABLE staged_jobs DISABLE ROW LEVEL SECURITY",
}
REFUSE_ONE = """
CREATE FUNCTION refuse_one() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.job_id = '{job_id}' THEN RAISE EXCEPTION 'job % is still needed', OLD.job_id; END IF;
    RETURN OLD;
END $$;
CREATE TRIGGER refuse_one BEFORE DELETE ON staged_jobs FOR EACH ROW EXECUTE FUNCTION refuse_one();
"""
REFERENCE = """
CREATE TABLE app_refs (job_id uuid REFERENCES staged_jobs (job_id) {action});
INSERT INTO app_refs VALUES ('{job_id}');
"""
REFUSALS = {
    "fk_restrict": REFERENCE.replace("{action}", "ON DELETE RESTRICT"),
    "fk_no_action": REFERENCE.replace("{action}", "ON DELETE NO ACTION"),
    "fk_deferred": REFERENCE.replace("{action}", "DEFERRABLE INITIALLY DEFERRED"),
    "trigger": REFUSE_ONE,
}


def stage(dsn: str, count: int) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [str(i) for i in drain.stage_many(conn, [drain.Job("app.t", args=[n]) for n in range(count)])]


execute = roles.execute


def scalar(dsn: str, query: str) -> object:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query.encode()).fetchone()
    return None if row is None else row[0]


def remaining(dsn: str) -> int:
    return int(str(scalar(dsn, "SELECT count(*) FROM staged_jobs")))


def gauge(the_relay: relay.Relay, name: str, **labels: str) -> float:
    return the_relay.metrics.registry.get_sample_value(name, labels) or 0.0


def counts(memory: testing.MemoryAdapter) -> collections.Counter[str]:
    return collections.Counter(str(job.job_id) for job in memory.published)


def turns(the_relay: relay.Relay, clock: ManualClock, count: int) -> None:
    """Go round the loop ``count`` times, the clock moved by each wait asked for."""
    for _ in range(count):
        clock.advance(the_relay.turn())


@pytest.fixture
def role_dsn(database: str) -> Iterator[str]:
    """The test database as a login role with the drain's grants (docs "Database setup"): not a
    superuser, so row-level security applies to it."""
    with roles.drain_role(database, prefix="drain_refusals") as dsn:
        yield dsn


def relay_as(
    settings: config.Settings, dsn: str, memory: testing.MemoryAdapter, clock: ManualClock, *, lead: bool
) -> relay.Relay:
    settings = dataclasses.replace(
        settings,
        dsn=dsn,
        batch_size=100,
        settle_timeout_s=SETTLE_TIMEOUT_S,
        backends={"default": config.BackendSettings("default", "memory", 3, {})},
    )
    the_relay = relay.Relay(settings, {"default": memory}, clock=clock, jitter=lambda: 0.0)
    if lead:
        assert the_relay.leadership.try_acquire()
    return the_relay


# --- 1. a DELETE that skips rows ------------------------------------------------------------


@pytest.mark.parametrize("skip", list(SKIPS))
def test_a_delete_that_skips_rows_is_a_settlement_failure_not_a_storm(
    skip: str, settings: config.Settings, database: str, role_dsn: str, clock: ManualClock
) -> None:
    memory = testing.MemoryAdapter("default")
    leader = relay_as(settings, role_dsn, memory, clock, lead=True)
    try:
        ids = stage(database, 5)
        execute(database, SKIPS[skip])  # after the lead's probe: it begins mid-run
        turns(leader, clock, 4)  # within settle_timeout_s
        assert sorted(counts(memory)) == sorted(ids) and max(counts(memory).values()) == 1
        assert leader.settler.held.failing and leader.settler.held.jobs == 5
        assert gauge(leader, "drain_cannot_settle", reason=leadership.SETTLEMENT_FAILED) == 1
        execute(database, HEAL_SKIPS[skip])
        steps_until(lambda: turns(leader, clock, 1), lambda _: remaining(database) == 0, "healed", 50)
    finally:
        leader.shutdown()
    assert max(counts(memory).values()) == 1 and len(counts(memory)) == 5


@pytest.mark.parametrize("skip", list(SKIPS))
def test_the_probe_finds_a_delete_that_skips_rows(
    skip: str, settings: config.Settings, database: str, role_dsn: str, clock: ManualClock
) -> None:
    memory = testing.MemoryAdapter("default")
    fresh = relay_as(settings, role_dsn, memory, clock, lead=False)
    try:
        stage(database, 5)
        execute(database, SKIPS[skip])
        fresh.turn()
        assert not fresh.leadership.is_leader and memory.published == []
        blocker = fresh.leadership.blocker
        assert blocker is not None and blocker.reason == leadership.DELETE_FAILS, blocker
        assert "without an error" in blocker.detail
    finally:
        fresh.shutdown()


# --- 2. every kind of settlement write ------------------------------------------------------

REFUSE_BURIAL = """
CREATE FUNCTION refuse_burial() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'no dead letters today'; END $$;
CREATE TRIGGER refuse_burial BEFORE INSERT ON staged_jobs_dead FOR EACH ROW EXECUTE FUNCTION refuse_burial();
"""
REFUSE_RETRY = """
CREATE FUNCTION refuse_retry() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'no backoff today'; END $$;
CREATE TRIGGER refuse_retry BEFORE UPDATE ON staged_jobs FOR EACH ROW EXECUTE FUNCTION refuse_retry();
"""


@pytest.mark.parametrize(
    ("fault", "reason", "words"),
    [
        (REFUSE_BURIAL, leadership.BURY_FAILS, "no dead letters"),
        (REFUSE_RETRY, leadership.RETRY_FAILS, "no backoff"),
    ],
    ids=["burial", "retry"],
)
def test_the_probe_tries_every_kind_of_settlement_write(
    fault: str, reason: str, words: str, settings: config.Settings, database: str, clock: ManualClock
) -> None:
    memory = testing.MemoryAdapter("default")
    fresh = relay_as(settings, database, memory, clock, lead=False)
    try:
        stage(database, 5)
        execute(database, fault)
        fresh.turn()
        assert not fresh.leadership.is_leader and memory.published == []
        blocker = fresh.leadership.blocker
        assert blocker is not None and blocker.reason == reason and words in blocker.detail, blocker
        assert remaining(database) == 5 and scalar(database, "SELECT count(*) FROM staged_jobs_dead") == 0
    finally:
        fresh.shutdown()


@pytest.mark.parametrize("part", ["burial", "retry"])
def test_a_failing_part_of_a_settlement_does_not_undo_the_delivered_rows(
    part: str, leader: relay.Relay, memory: testing.MemoryAdapter, database: str, clock: ManualClock
) -> None:
    ids = stage(database, 10)
    refused = ids[4]
    memory.behaviour = lambda job: "reject" if str(job.job_id) == refused else "ack"
    if part == "burial":  # its last attempt: rejected now, it is buried
        execute(database, f"UPDATE staged_jobs SET attempts = 2 WHERE job_id = '{refused}'")
        execute(database, REFUSE_BURIAL)
    else:
        execute(database, REFUSE_RETRY.replace("BEFORE UPDATE", "BEFORE UPDATE OF attempts"))
    leader.turn()
    assert remaining(database) == 1, "the delivered rows were not deleted with the refused one"
    assert not leader.settler.held.failing
    turns(leader, clock, 5)
    assert len(memory.published) == 9 and remaining(database) == 1
    if part == "burial":  # dead, and refused by the dead letters: parked in place, said why
        [(job_id, error)] = parked(database)
        assert job_id == refused and "no dead letters today" in error, error
        assert leader.settler.held.jobs == 0
    else:  # its backoff cannot be written: held by the drain, out of selection
        assert leader.settler.held.jobs == 1 and gauge(leader, "drain_unsettled_jobs") == 1


# --- 3. (id, job_id) ------------------------------------------------------------------------


def test_a_settlement_leaves_a_row_that_reused_a_published_id(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    adapter = testing.PipelinedMemoryAdapter("default")
    leader = relays.leading(settings, {"default": adapter}, clock, pipeline_depth=2)
    try:
        ids = stage(database, 3)
        leader.drain_step()  # all 3 submitted, their rows not locked until settled
        reused = int(str(scalar(database, f"SELECT id FROM staged_jobs WHERE job_id = '{ids[1]}'")))
        newcomer = str(uuid.uuid4())
        execute(  # an app cancels that job and stages another under the same id
            database,
            f"DELETE FROM staged_jobs WHERE id = {reused}; "
            f"INSERT INTO staged_jobs (id, job_name, job_id) OVERRIDING SYSTEM VALUE "
            f"VALUES ({reused}, 'app.t', '{newcomer}')",
        )
        leader.settle_in_flight()
        steps_until(leader.drain_step, lambda _: remaining(database) == 0, "draining", 10)
        leader.settle_in_flight()
    finally:
        leader.shutdown()
    assert newcomer in counts(adapter), "the row that reused a published id was deleted unpublished"
    assert max(counts(adapter).values()) == 1


# --- 4. one refused row ---------------------------------------------------------------------


def parked(database: str) -> list[tuple[str, str]]:
    with psycopg.connect(database) as conn:
        rows = conn.execute(
            "SELECT job_id::text, last_error FROM staged_jobs WHERE run_at = %s", [writes.PARKED_AT]
        ).fetchall()
    return [(str(job_id), str(error)) for job_id, error in rows]


def status(database: str) -> dict[str, object]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["status", "--json", "--dsn", database], env={}) == 0
    report: dict[str, object] = json.loads(out.getvalue())
    return report


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_one_row_the_table_refuses_is_parked_and_the_rest_flow(
    refusal: str, leader: relay.Relay, memory: testing.MemoryAdapter, database: str, clock: ManualClock
) -> None:
    ids = stage(database, 10)
    refused = ids[3]
    execute(database, REFUSALS[refusal].replace("{job_id}", refused))
    turns(leader, clock, 3)
    assert remaining(database) == 1 and not leader.settler.held.failing
    [(job_id, error)] = parked(database)
    assert job_id == refused and "published" in error, error
    later = stage(database, 5)  # the rest flow; the parked row is not published again
    turns(leader, clock, 5)
    assert remaining(database) == 1 and set(counts(memory)) == set(ids + later)
    assert max(counts(memory).values()) == 1
    assert gauge(leader, "drain_parked_jobs_total") == 1
    assert status(database)["parked"] == 1
    leader.shutdown()
    again = relays.leading(leader.settings, {"default": memory}, clock)  # a restarted drain
    try:
        turns(again, clock, 3)
    finally:
        again.shutdown()
    assert max(counts(memory).values()) == 1 and remaining(database) == 1


@pytest.mark.parametrize("refusal", ["fk_restrict", "trigger"])
def test_a_refused_row_alone_is_parked_once_a_row_of_the_drains_own_shows_the_table_takes_deletes(
    refusal: str, leader: relay.Relay, memory: testing.MemoryAdapter, database: str, clock: ManualClock
) -> None:
    [refused] = stage(database, 1)
    execute(database, REFUSALS[refusal].replace("{job_id}", refused))
    turns(leader, clock, 3)
    assert not leader.settler.held.failing and [job for job, _ in parked(database)] == [refused]
    assert set(counts(memory)) == {refused} and remaining(database) == 1


@pytest.mark.parametrize("refusal", ["fk_restrict", "trigger"])
def test_without_insert_a_refused_row_alone_waits_for_a_row_that_proves_the_table_takes_deletes(
    refusal: str, settings: config.Settings, database: str, role_dsn: str, clock: ManualClock
) -> None:
    memory = testing.MemoryAdapter("default")
    leader = relay_as(settings, role_dsn, memory, clock, lead=True)  # no row of its own: no INSERT
    try:
        [refused] = stage(database, 1)
        execute(database, REFUSALS[refusal].replace("{job_id}", refused))
        turns(leader, clock, 3)
        assert leader.settler.held.failing and parked(database) == []  # one row alone: it may be the table
        later = stage(database, 5)
        turns(leader, clock, 5)  # its next attempt probes the new rows: only that row is refused
        assert not leader.settler.held.failing and [job for job, _ in parked(database)] == [refused]
    finally:
        leader.shutdown()
    assert set(counts(memory)) == {refused, *later} and max(counts(memory).values()) == 1
    assert remaining(database) == 1


# --- 5. settle_timeout_s ----------------------------------------------------------------------


RAISING_TRIGGER = """
CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'refusing to delete staged job %', OLD.job_id; END $$;
CREATE TRIGGER refuse_delete BEFORE DELETE ON staged_jobs FOR EACH ROW EXECUTE FUNCTION refuse_delete();
"""


def test_a_persistent_failure_ends_the_loop_at_settle_timeout_not_a_backoff_later(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    memory = testing.MemoryAdapter("default")
    leader = relay_as(settings, database, memory, clock, lead=True)
    try:
        stage(database, 5)
        execute(database, RAISING_TRIGGER)
        started = clock.now  # the failure begins at this turn
        clock.advance(leader.turn())
        stage(database, 5)
        with pytest.raises(errors.CannotSettle, match="refusing to delete"):
            for _ in range(1000):
                clock.advance(leader.turn())
        overshoot = clock.now - started - SETTLE_TIMEOUT_S
    finally:
        leader.shutdown()
    assert overshoot <= 1e-6, f"exited {overshoot:.2f}s after settle_timeout_s"
    assert len(memory.published) == 5
