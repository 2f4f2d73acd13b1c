"""Red team 32: per-key order (G9) under a property-based model of the relay, a real Postgres
and the in-memory backend (the state machine of tests/faults has no keys).

Hypothesis interleaves: keyed jobs (three keys, some delayed) each staged in its own committed
transaction (so a key's staging order is its id order), unkeyed jobs in transactions held open
and committed later, an app locking a staged row for a while, the broker acking, nacking,
rejecting or down, time passing, pipelined turns and whole batches, the leader's lock session
killed, ``drain dead retry`` and ``drain dead purge``. The check is made where G9 says: whenever
a job is handed to the broker (published, or submitted to a pipelined backend), no row of its key
with a lower id is still in the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import psycopg
import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import drain
from drain import cli, config, models, testing
from drain.relay import loop as relay
from tests.support import postgres

KEYS = ("a", "b", "c")
MODES = ("ack", "reject", "retry", "down")


class CheckedAdapter(testing.PipelinedMemoryAdapter):
    """Checks G9 for every job at the moment the broker gets it."""

    def __init__(self, admin: psycopg.Connection) -> None:  # type: ignore[type-arg]
        super().__init__("default")
        self.admin = admin
        self.violations: list[str] = []
        self.collecting = False

    def check(self, jobs: Sequence[models.StagedJob]) -> None:
        for job in jobs:
            if job.ordering_key is None:
                continue
            ahead = self.admin.execute(
                "SELECT id, job_name FROM staged_jobs WHERE ordering_key = %s AND id < %s",
                (job.ordering_key, job.id),
            ).fetchall()
            if ahead:
                self.violations.append(f"{job.job_name} (id {job.id}) handed over while {ahead} staged")

    def submit(self, jobs: Sequence[models.StagedJob], /) -> list[models.StagedJob]:
        if not self.down:
            self.check(jobs)
        return super().submit(jobs)

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        if not self.collecting and not self.down:
            self.check(jobs)  # a whole batch (drain_once): handed over now
        return super().publish_batch(jobs)

    def collect(self, ticket: list[models.StagedJob], /) -> list[models.PublishResult]:
        self.collecting = True  # a pipelined batch was handed over at submit
        try:
            return super().collect(ticket)
        finally:
            self.collecting = False


class KeyedMachine(RuleBasedStateMachine):
    def __init__(self, dsn: str, base: config.Settings, block: bool) -> None:
        super().__init__()
        self.dsn = dsn
        self.admin = psycopg.connect(dsn, autocommit=True)
        self.admin.execute("TRUNCATE staged_jobs, staged_jobs_dead")
        self.now = 0.0
        self.mode = "ack"
        self.counter = 0
        self.held: list[psycopg.Connection] = []  # type: ignore[type-arg]
        self.locks: list[psycopg.Connection] = []  # type: ignore[type-arg]
        self.memory = CheckedAdapter(psycopg.connect(dsn, autocommit=True))
        self.memory.behaviour = lambda job: self.mode  # type: ignore[assignment,return-value]
        section = config.BackendSettings("default", "memory", 2, {}, block_on_dead_letter=block)
        the_settings = dataclasses.replace(
            base,
            batch_size=3,
            pipeline_depth=2,
            retry_base_s=0.001,
            retry_max_s=0.001,
            backends={"default": section},
        )
        self.relay = relay.Relay(
            the_settings, {"default": self.memory}, clock=lambda: self.now, jitter=lambda: 0.0
        )
        assert self.relay.leadership.try_acquire()

    @rule(mode=st.sampled_from(MODES))
    def set_broker(self, mode: str) -> None:
        self.mode = mode

    @rule(key=st.sampled_from(KEYS), delayed=st.booleans())
    def stage_keyed(self, key: str, delayed: bool) -> None:
        self.counter += 1
        with psycopg.connect(self.dsn) as conn:
            drain.stage(conn, f"{key}{self.counter}", ordering_key=key, delay=60 if delayed else None)

    @precondition(lambda self: len(self.held) < 2)
    @rule()
    def hold_unkeyed(self) -> None:
        conn = psycopg.connect(self.dsn)
        drain.stage(conn, "free")
        self.held.append(conn)

    @precondition(lambda self: bool(self.held))
    @rule(commit=st.booleans())
    def finish_held(self, commit: bool) -> None:
        conn = self.held.pop(0)
        conn.commit() if commit else conn.rollback()
        conn.close()

    @precondition(lambda self: len(self.locks) < 2)
    @rule(key=st.sampled_from(KEYS))
    def app_locks_first_row_of(self, key: str) -> None:
        conn = psycopg.connect(self.dsn)
        conn.execute(
            "SELECT 1 FROM staged_jobs WHERE id = (SELECT min(id) FROM staged_jobs WHERE ordering_key = %s) "
            "FOR UPDATE SKIP LOCKED",
            (key,),
        )
        self.locks.append(conn)

    @precondition(lambda self: bool(self.locks))
    @rule()
    def app_unlocks(self) -> None:
        conn = self.locks.pop(0)
        conn.rollback()
        conn.close()

    @rule()
    def time_passes(self) -> None:
        self.admin.execute(  # not the rows an app locks (it would wait for the app)
            "UPDATE staged_jobs SET run_at = now() - interval '1 second' WHERE id IN "
            "(SELECT id FROM staged_jobs WHERE run_at > now() FOR UPDATE SKIP LOCKED)"
        )
        self.now += 3600.0

    @rule()
    def relay_step(self) -> None:
        self.relay.drain_once()

    @rule()
    def relay_turn(self) -> None:
        self.relay.turn()

    @rule()
    def dead_retry(self) -> None:
        assert cli.main(["dead", "retry", "--dsn", self.dsn], env={}) == cli.EXIT_OK

    @rule()
    def dead_purge(self) -> None:
        assert cli.main(["dead", "purge", "--yes", "--dsn", self.dsn], env={}) == cli.EXIT_OK

    @precondition(lambda self: self.relay.leadership.is_leader)
    @rule()
    def kill_lock_session(self) -> None:
        pid = self.relay.leadership.pid
        postgres.terminate(self.admin, pid)
        self.relay.turn()
        self.relay.turn()

    @invariant()
    def each_key_goes_in_order(self) -> None:
        assert not self.memory.violations, self.memory.violations

    def teardown(self) -> None:
        try:
            for conn in self.held + self.locks:
                conn.rollback()
            self.mode = "ack"
            for _ in range(300):
                self.time_passes()
                self.relay.turn()
                if self.admin.execute("SELECT count(*) FROM staged_jobs").fetchone() == (0,):
                    break
                if self.admin.execute("SELECT count(*) FROM staged_jobs_dead").fetchone() != (0,):
                    self.dead_purge()  # a blocking dead letter holds its key
            else:
                raise AssertionError("the table never emptied")
            self.each_key_goes_in_order()
        finally:
            for conn in self.held + self.locks:
                conn.close()
            self.relay.shutdown()
            self.memory.admin.close()
            self.admin.close()


@pytest.mark.parametrize("block", [False, True], ids=["lets-go", "blocks"])
def test_keyed_state_machine(database: str, settings: config.Settings, block: bool) -> None:
    run_state_machine_as_test(
        lambda: KeyedMachine(database, settings, block),
        settings=hypothesis_settings(
            max_examples=20,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )
