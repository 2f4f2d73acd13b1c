"""Per-key order, as a property of the relay: a Hypothesis state machine over a real Postgres and
the in-memory pipelined backend.

Hypothesis interleaves: stagings with ordering keys (three keys, one of them twice as likely, so
they collide, and rows without one), some deferred (an hour ahead, or already passed: a row whose
run_at is earlier than its predecessor's); what the broker does per job (ack, nack, reject, be
down, or mixed: by the job, a row in four nacked once and one in four rejected until it is dead);
time passing (retries and deferred rows fall due); the relay's turns (pipelined, depth 2: batches
stay in flight and are settled by a later step) and whole batches; crashes of the leader at a
step's failpoints, after the select, after publishing, after the DELETE, after the COMMIT (the
process dies: its transaction rolls back, its batches in flight are never collected, a new leader
takes over and forwards again what was not deleted); `drain dead retry` and `purge`.

The broker checks every row as it is handed over (submitted to a pipelined batch, which a real
broker may deliver even if the confirm never comes back, or published): no lower id of its key is
staged (whatever that row's state), and under block_on_dead_letter no dead letter of its key
exists; every lower id of its key not yet forwarded is then dead (without the setting) or purged.
At the end, per key, the first handover of each row is in id order but for those excused gaps,
and every committed row was forwarded, is dead or was purged.
"""

from __future__ import annotations

import collections
import dataclasses
import uuid
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

from drain import config, models, testing
from drain.relay import failpoints
from drain.relay import loop as relay
from drain.store import admin, sql

MAX_ATTEMPTS = 2
KEYS = (None, "a", "a", "b", "c")
MODES = ("ack", "retry", "reject", "down", "mixed")
MIXED = ("ack", "ack", "retry", "reject")  # by the job's argument; "retry" (a nack) the first time only
CRASH_POINTS = ("after_select", "after_publish", "after_delete", "after_commit")
DELAYS = (None, None, None, "future", "passed")
RUN_AT = {None: "NULL", "future": "now() + interval '1 hour'", "passed": "now() - interval '1 second'"}


class Crash(BaseException):
    """The leader process dies here (nothing in the relay catches a BaseException)."""


class CrashAt(failpoints.Failpoints):
    """Failpoints that kill the leader once at ``at``."""

    def __init__(self) -> None:
        super().__init__()
        self.at: str | None = None

    def hit(self, name: str) -> None:
        if name == self.at:
            self.at = None
            raise Crash(name)


class CheckingBroker(testing.PipelinedMemoryAdapter):
    """The in-memory pipelined backend, checking each keyed row as it is handed over (submit or
    publish) against the table as committed, and keeping the order of the first handovers."""

    def __init__(self, machine: OrderingMachine) -> None:
        super().__init__("default")
        self.machine = machine

    def submit(self, jobs: Sequence[models.StagedJob], /) -> list[models.StagedJob]:
        if not self.down:
            self.machine.handed_over(jobs)
        return super().submit(jobs)

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        results = super().publish_batch(jobs)
        self.machine.handed_over([job for job, result in zip(jobs, results, strict=True) if result.published])
        return results

    def collect(self, ticket: list[models.StagedJob], /) -> list[models.PublishResult]:
        """The confirms of a batch handed over (and checked) at its submit: the parent answers them
        with its publish_batch, which is not a second handover. Checking them here found a row
        "handed over" after a dead letter of its key, retried meanwhile, was staged again — a row
        that had reached the broker while that one was dead, as the setting allows."""
        self.outstanding -= 1
        return testing.PipelinedMemoryAdapter.publish_batch(self, ticket)


class OrderingMachine(RuleBasedStateMachine):
    blocking = False

    def __init__(self, dsn: str, base: config.Settings) -> None:
        super().__init__()
        self.dsn = dsn
        self.db = psycopg.connect(dsn, autocommit=True)
        self.db.execute("TRUNCATE staged_jobs, staged_jobs_dead")
        self.admin = admin.Admin(self.db, sql.Names("public", "staged_jobs"))
        self.now = 0.0
        self.mode = "mixed"  # a row in four rejected, and dead after MAX_ATTEMPTS turns
        self.counter = 0
        self.keys: dict[int, str | None] = {}  # every committed row: id -> key
        self.job_ids: dict[int, uuid.UUID] = {}  # and its job_id (a dead letter retried without a
        # key is staged again under a new id)
        self.forwarded: list[int] = []  # first handovers, in order
        self.excused: dict[int, set[int]] = {}  # row -> the lower ids of its key gone when it went
        self.purged: set[int] = set()
        self.purged_jobs: set[uuid.UUID] = set()
        self.crashes = 0
        self.violations: list[str] = []
        self.nacked: collections.Counter[uuid.UUID] = collections.Counter()
        self.broker = CheckingBroker(self)
        self.broker.behaviour = self._behave
        self.settings = dataclasses.replace(
            base,
            batch_size=4,
            pipeline_depth=2,
            max_attempts=MAX_ATTEMPTS,
            retry_base_s=0.001,
            retry_max_s=0.001,
            wakeup="poll",
            backends={
                "default": config.BackendSettings(
                    "default", "memory", MAX_ATTEMPTS, {}, block_on_dead_letter=self.blocking
                )
            },
        )
        self.relay = self._lead()

    def _lead(self) -> relay.Relay:
        """A new leader process over the same broker."""
        fresh = relay.Relay(
            self.settings,
            {"default": self.broker},
            clock=lambda: self.now,
            jitter=lambda: 0.0,
            failpoints_=CrashAt(),
        )
        assert fresh.leadership.try_acquire()
        return fresh

    # --- the broker -------------------------------------------------------------------------

    def _behave(self, job: models.StagedJob) -> testing.Behaviour:
        if self.mode != "mixed":
            return self.mode  # type: ignore[return-value]
        mode = MIXED[job.args[0] % len(MIXED)]
        self.nacked[job.job_id] += mode == "retry"
        return "ack" if mode == "retry" and self.nacked[job.job_id] > 1 else mode  # type: ignore[return-value]

    @rule(mode=st.sampled_from(MODES))
    def set_broker(self, mode: str) -> None:
        self.mode = mode

    def handed_over(self, jobs: Sequence[models.StagedJob]) -> None:
        """What must hold as each row reaches the broker (see the module docstring). Recorded,
        not raised: the relay takes an adapter's exception for a rejection of the batch."""
        for job in jobs:
            self.violations.extend(self._violations(job))

    def _violations(self, job: models.StagedJob) -> list[str]:
        """Record ``job``'s first handover; what it breaks, if anything."""
        if job.id not in self.keys:  # a dead letter without a key, staged again: a new row
            self.keys[job.id], self.job_ids[job.id] = None, job.job_id
        if job.id not in self.excused:
            self.forwarded.append(job.id)
        if job.ordering_key is None:
            self.excused.setdefault(job.id, set())
            return []
        key, found = job.ordering_key, []
        ahead = self._ids("SELECT id FROM staged_jobs WHERE ordering_key = %s AND id < %s", key, job.id)
        if ahead:
            found.append(f"row {job.id} (key {key}) handed over while {sorted(ahead)} of its key are staged")
        dead = self._ids("SELECT id FROM staged_jobs_dead WHERE ordering_key = %s", key, None)
        if self.blocking and dead:
            found.append(f"row {job.id} (key {key}) handed over while {sorted(dead)} of its key are dead")
        gone = {i for i, k in self.keys.items() if k == key and i < job.id} - set(self.forwarded)
        allowed = self.purged if self.blocking else self.purged | dead
        if not gone <= allowed:
            found.append(f"row {job.id} (key {key}) overtook {sorted(gone - allowed)}")
        self.excused.setdefault(job.id, gone)
        return found

    def _ids(self, query: str, key: str, below: int | None) -> set[int]:
        params = (key, below) if below is not None else (key,)
        return {int(row[0]) for row in self.db.execute(query, params).fetchall()}

    # --- apps and operators -----------------------------------------------------------------

    @rule(rows=st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(DELAYS)), min_size=1, max_size=4))
    def stage(self, rows: list[tuple[str | None, str | None]]) -> None:
        """Rows staged one transaction after the other (the order the guarantee covers)."""
        for key, delay in rows:
            found = self.db.execute(
                f"INSERT INTO staged_jobs (job_name, job_args, ordering_key, run_at) "
                f"VALUES ('app.t', %s, %s, {RUN_AT[delay]}) RETURNING id, job_id",
                (psycopg.types.json.Jsonb([self.counter]), key),
            ).fetchone()
            assert found is not None
            self.keys[int(found[0])], self.job_ids[int(found[0])] = key, found[1]
            self.counter += 1

    @rule()
    def time_passes(self) -> None:
        """Retries and deferred rows fall due; a paused backend is tried again."""
        self.db.execute("UPDATE staged_jobs SET run_at = now() - interval '1 second' WHERE run_at > now()")
        self.now += 3600.0

    @rule(everything=st.booleans())
    def dead_retry(self, everything: bool) -> None:
        oldest = self.db.execute("SELECT min(dead_id) FROM staged_jobs_dead").fetchone()
        if oldest is None or oldest[0] is None:
            return
        self.admin.dead_retry(admin.DeadFilter(ids=None if everything else [int(oldest[0])]))

    @rule()
    def dead_purge(self) -> None:
        row = self.db.execute("SELECT dead_id, id FROM staged_jobs_dead ORDER BY dead_id LIMIT 1").fetchone()
        if row is None:
            return
        self.admin.dead_purge(admin.DeadFilter(ids=[int(row[0])]))
        self.purged.add(int(row[1]))
        self.purged_jobs.add(self.job_ids[int(row[1])])

    # --- the drain --------------------------------------------------------------------------

    @rule(turns=st.integers(1, 6), later=st.booleans())
    def relay_turns(self, turns: int, later: bool) -> None:
        """The loop going round (a row goes dead after a few turns of rejections); ``later``: with
        time passing before each turn (the nacked and deferred rows fall due)."""
        for _ in range(turns):
            if later:
                self.time_passes()
            self.relay.turn()

    @rule()
    def relay_whole_batch(self) -> None:
        if self.relay.leadership.is_leader:
            self.relay.drain_once()

    @precondition(lambda self: self.crashes < 3)
    @rule(point=st.sampled_from(CRASH_POINTS))
    def crash(self, point: str) -> None:
        """The leader dies at ``point`` in its next turn, if it gets there; a new one leads."""
        points = self.relay.failpoints
        assert isinstance(points, CrashAt)
        points.at = point
        try:
            self.relay.turn()
        except Crash:
            self.crashes += 1
            self.relay.store.close()  # the process is gone: so are its session, lock and flights
            self.relay = self._lead()
        points.at = None

    # --- what must hold ---------------------------------------------------------------------

    @invariant()
    def no_row_reached_the_broker_ahead_of_its_key(self) -> None:
        assert not self.violations, self.violations[:3]

    @invariant()
    def every_first_handover_is_in_key_order_but_for_excused_gaps(self) -> None:
        seen: dict[str, list[int]] = collections.defaultdict(list)
        for row in self.forwarded:
            key = self.keys[row]
            if key is None:
                continue
            overtaken = [earlier for earlier in seen[key] if earlier > row]
            for earlier in overtaken:  # a higher id went first: only past a gap this row left
                assert row in self.excused[earlier], f"key {key}: {earlier} reached the broker before {row}"
            seen[key].append(row)

    def teardown(self) -> None:
        try:
            self.mode = "ack"
            for _ in range(100):
                self.dead_retry(everything=True)
                self.time_passes()
                self.relay.turn()
                left = self.db.execute("SELECT count(*) FROM staged_jobs").fetchone()
                dead = self.db.execute("SELECT count(*) FROM staged_jobs_dead").fetchone()
                if left == (0,) and dead == (0,) and not self.relay.in_flight:
                    break
            else:
                raise AssertionError("the table never emptied")
            forwarded = {self.job_ids[row] for row in self.forwarded}
            assert set(self.job_ids.values()) == forwarded | self.purged_jobs
        finally:
            self.relay.shutdown()
            self.db.close()


class BlockingMachine(OrderingMachine):
    blocking = True


@pytest.mark.parametrize(
    "machine", [OrderingMachine, BlockingMachine], ids=["dead-letters-let-go", "blocking"]
)
def test_rows_of_a_key_reach_the_broker_in_id_order(
    database: str, settings: config.Settings, machine: type[OrderingMachine]
) -> None:
    run_state_machine_as_test(
        lambda: machine(database, settings),
        settings=hypothesis_settings(
            max_examples=25,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )
