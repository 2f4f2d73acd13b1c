"""A property-based model of the relay against a real Postgres and the in-memory backend.

Hypothesis interleaves what apps and operators do — commit jobs, roll them back, hold a
transaction open and commit it later (so ids commit out of order), change what the broker does
per job (ack, nack, reject, be down), kill the leader's lock session — with the relay's own loop
body (``Relay.turn``: a pipelined step at depth 2, whose batches stay in flight and are settled by
a later step, the broker deciding their fate only then; stepping down and leading again on its
own after its session is killed) and whole batches (``Relay.drain_once``). After every step:

- delivered ⊆ committed (nothing rolled back or not yet committed ever reaches the broker);
- no job is delivered twice (no process dies here, so nothing may be forwarded again);
- the dead-letter table holds exactly the jobs the broker rejected ``max_attempts`` times.

At the end the broker heals, held transactions commit and the relay drains to empty (making
backed-off rows due): committed ⊆ delivered ∪ dead-lettered, and nothing else is dead.
"""

from __future__ import annotations

import collections
import dataclasses
import uuid

import psycopg
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
from drain import config, models, testing
from drain.relay import loop as relay
from tests.support import postgres

MAX_ATTEMPTS = 2
MAX_HELD = 2
MODES = ("ack", "reject", "retry", "down", "mixed")
MIXED = ("ack", "reject", "retry")


class RelayMachine(RuleBasedStateMachine):
    def __init__(self, dsn: str, base: config.Settings) -> None:
        super().__init__()
        self.dsn = dsn
        self.admin = psycopg.connect(dsn, autocommit=True)
        self.admin.execute("TRUNCATE staged_jobs, staged_jobs_dead")
        self.now = 0.0
        self.mode = "ack"
        self.counter = 0
        self.committed: set[uuid.UUID] = set()
        self.rolled_back: set[uuid.UUID] = set()
        self.rejects: collections.Counter[uuid.UUID] = collections.Counter()
        self.held: list[tuple[psycopg.Connection[tuple[object, ...]], list[uuid.UUID]]] = []
        self.memory = testing.PipelinedMemoryAdapter("default")
        self.memory.behaviour = self._behave
        the_settings = dataclasses.replace(
            base,
            batch_size=3,
            pipeline_depth=2,
            max_attempts=MAX_ATTEMPTS,
            retry_base_s=0.001,
            retry_max_s=0.001,
            backends={"default": config.BackendSettings("default", "memory", MAX_ATTEMPTS, {})},
        )
        self.relay = relay.Relay(
            the_settings, {"default": self.memory}, clock=lambda: self.now, jitter=lambda: 0.0
        )
        assert self.relay.leadership.try_acquire()

    # --- the broker -------------------------------------------------------------------------

    def _behave(self, job: models.StagedJob) -> testing.Behaviour:
        mode = MIXED[job.args[0] % len(MIXED)] if self.mode == "mixed" else self.mode
        what: testing.Behaviour = mode  # type: ignore[assignment]
        if what == "reject":
            self.rejects[job.job_id] += 1  # "mixed" never raises, so every reject is recorded
        return what

    @rule(mode=st.sampled_from(MODES))
    def set_broker(self, mode: str) -> None:
        self.mode = mode

    # --- apps -------------------------------------------------------------------------------

    def _jobs(self, count: int) -> list[drain.Job]:
        jobs = [drain.Job("app.t", args=[self.counter + n]) for n in range(count)]
        self.counter += count
        return jobs

    @rule(count=st.integers(1, 4))
    def commit_jobs(self, count: int) -> None:
        with psycopg.connect(self.dsn) as conn:
            self.committed.update(drain.stage_many(conn, self._jobs(count)))

    @rule(count=st.integers(1, 3))
    def roll_back_jobs(self, count: int) -> None:
        with psycopg.connect(self.dsn) as conn:
            self.rolled_back.update(drain.stage_many(conn, self._jobs(count)))
            conn.rollback()

    @precondition(lambda self: len(self.held) < MAX_HELD)
    @rule(count=st.integers(1, 3))
    def hold_transaction(self, count: int) -> None:
        conn = psycopg.connect(self.dsn)
        self.held.append((conn, drain.stage_many(conn, self._jobs(count))))

    @precondition(lambda self: bool(self.held))
    @rule(commit=st.booleans())
    def finish_held(self, commit: bool) -> None:
        conn, job_ids = self.held.pop(0)
        if commit:
            conn.commit()
            self.committed.update(job_ids)
        else:
            conn.rollback()
            self.rolled_back.update(job_ids)
        conn.close()

    @rule()
    def time_passes(self) -> None:
        """Backed-off rows fall due, and paused backends are tried again."""
        self.admin.execute("UPDATE staged_jobs SET run_at = now() - interval '1 second' WHERE run_at > now()")
        self.now += 3600.0

    # --- the drain --------------------------------------------------------------------------

    @rule()
    def relay_step(self) -> None:
        self.relay.drain_once()

    @rule()
    def relay_turn(self) -> None:
        self.relay.turn()

    @precondition(lambda self: self.relay.leadership.is_leader)
    @rule()
    def kill_lock_session(self) -> None:
        pid = self.relay.leadership.pid
        postgres.terminate(self.admin, pid)
        delivered = len(self.memory.published)
        self.relay.turn()  # its batch fails on the dead session: it steps down, forwarding nothing
        assert not self.relay.leadership.is_leader
        assert len(self.memory.published) == delivered, "a leader whose lock session was killed forwarded"
        self.relay.turn()  # nobody else leads: it takes the lock again on a new session
        assert self.relay.leadership.is_leader and self.relay.leadership.pid != pid

    # --- what must hold ---------------------------------------------------------------------

    def delivered(self) -> set[uuid.UUID]:
        return {job.job_id for job in self.memory.published}

    @invariant()
    def nothing_is_delivered_twice(self) -> None:
        counts = collections.Counter(job.job_id for job in self.memory.published)
        assert max(counts.values(), default=0) <= 1, counts.most_common(1)

    def dead(self) -> set[uuid.UUID]:
        return {row[0] for row in self.admin.execute("SELECT job_id FROM staged_jobs_dead").fetchall()}

    @invariant()
    def only_committed_jobs_are_delivered(self) -> None:
        assert self.delivered() <= self.committed

    @invariant()
    def dead_letters_are_exactly_the_rejected_ones(self) -> None:
        assert max(self.rejects.values(), default=0) <= MAX_ATTEMPTS
        assert self.dead() == {job_id for job_id, count in self.rejects.items() if count == MAX_ATTEMPTS}

    def teardown(self) -> None:
        try:
            self.mode = "ack"
            while self.held:
                self.finish_held(commit=True)
            for _ in range(200):
                self.time_passes()
                self.relay.turn()
                left = self.admin.execute("SELECT count(*) FROM staged_jobs").fetchone()
                if left == (0,):
                    break
            else:
                raise AssertionError("the table never emptied")
            dead = self.dead()
            assert self.committed <= self.delivered() | dead
            assert not (self.delivered() | dead) & self.rolled_back
            assert dead == {job_id for job_id, count in self.rejects.items() if count == MAX_ATTEMPTS}
        finally:
            for conn, _ in self.held:
                conn.close()
            self.relay.shutdown()
            self.admin.close()


def test_relay_state_machine(database: str, settings: config.Settings) -> None:
    run_state_machine_as_test(
        lambda: RelayMachine(database, settings),
        settings=settings_for_ci(),
    )


def settings_for_ci() -> hypothesis_settings:
    return hypothesis_settings(
        max_examples=30,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        database=None,
    )
