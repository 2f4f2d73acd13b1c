"""Per-key order on the operations side: `drain status` and the leader's gauges count the keys held
back, `drain dead list` shows a dead letter's key, and a held key never keeps the leader awake."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from typing import Any

import psycopg
import pytest

from drain import cli, config, testing
from drain.relay import loop as relay
from tests.conftest import ManualClock
from tests.support import relays

BLOCKING_ENV = {
    "DRAIN_BACKENDS__DEFAULT__TYPE": "memory",
    "DRAIN_BACKENDS__DEFAULT__BLOCK_ON_DEAD_LETTER": "true",
}


def add(dsn: str, name: str, key: str | None, run_at: str = "NULL", created_at: str = "now()") -> int:
    """Stage one row (its times as SQL expressions); return its id."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO staged_jobs (job_name, ordering_key, run_at, created_at) "
            f"VALUES (%s, %s, {run_at}, {created_at}) RETURNING id",
            (name, key),
        ).fetchone()
    assert row is not None
    return int(row[0])


def bury(dsn: str, name: str) -> None:
    """Move a staged row to the dead letters, as the drain buries one."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "WITH gone AS (DELETE FROM staged_jobs WHERE job_name = %s RETURNING *) "
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id, "
            "run_at, options, created_at, attempts, last_error, error, ordering_key) "
            "SELECT id, job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options, "
            "created_at, attempts + 1, 'refused', 'refused', ordering_key FROM gone",
            (name,),
        )


def command(argv: list[str], env: dict[str, str] | None = None) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(argv, env=env or {}) == cli.EXIT_OK
    return out.getvalue()


def status(dsn: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(command(["status", "--json", "--dsn", dsn], env))
    return report


@pytest.fixture
def held(database: str) -> dict[str, int]:
    """Key a: a1 waits for its retry, a2 (staged 2 hours ago) and a3 (fell due an hour ago) wait
    behind it; key b and an unkeyed row flow; key c's first row is a dead letter."""
    ids = {
        "a1": add(database, "a1", "a", run_at="now() + interval '1 hour'"),
        "a2": add(database, "a2", "a", created_at="now() - interval '2 hours'"),
        "a3": add(database, "a3", "a", run_at="now() - interval '1 hour'"),
        "b1": add(database, "b1", "b"),
        "free": add(database, "free", None),
        "c1": add(database, "c1", "c"),
        "c2": add(database, "c2", "c"),
    }
    bury(database, "c1")
    return ids


def test_status_counts_the_keys_held_back_and_the_oldest_row(
    database: str, held: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    report = status(database)
    assert (report["blocked"], report["blocked_keys"]) == (2, 1)  # a2 and a3; c2 goes on
    oldest = report["oldest_blocked"]
    assert (oldest["id"], oldest["ordering_key"], oldest["behind"]) == (held["a2"], "a", held["a1"])
    assert 7100 < oldest["age_s"] < 7300
    assert report["due"] == 5  # held rows are due: counted there too
    # The backend blocks on dead letters (the config `drain status` reads): c2 waits too.
    blocking = status(database, BLOCKING_ENV)
    assert (blocking["blocked"], blocking["blocked_keys"]) == (3, 2)
    text = command(["status", "--dsn", database], BLOCKING_ENV)
    assert (
        f"  blocked  2 key(s), 3 due row(s) waiting for a lower id of their ordering key; oldest row "
        f'{held["a2"]} (key "a", ' in text
    ), text
    assert f"), behind row {held['a1']}\n" in text
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs WHERE ordering_key = 'a'")
    oldest = status(database, BLOCKING_ENV)["oldest_blocked"]
    assert (oldest["id"], oldest["behind"]) == (held["c2"], None)
    text = command(["status", "--dsn", database], BLOCKING_ENV)
    assert "behind a dead letter of its key (block_on_dead_letter)" in text
    assert "blocked" not in command(["status", "--dsn", database])  # without it nothing waits
    assert status(database)["oldest_blocked"] is None


def gauge(leader: relay.Relay, name: str) -> float | None:
    value: float | None = leader.metrics.registry.get_sample_value(name)
    return value


def test_the_leader_exports_the_blocked_keys_as_gauges(
    settings: config.Settings, database: str, held: dict[str, int], clock: ManualClock
) -> None:
    leader = relays.leading(
        settings, {"default": testing.MemoryAdapter("default")}, clock, block_on_dead_letter=True
    )
    try:
        leader.refresh_figures(force=True)
        assert gauge(leader, "drain_blocked_keys") == 2
        assert gauge(leader, "drain_blocked_jobs") == 3
        age = gauge(leader, "drain_oldest_blocked_age_seconds")
        assert age is not None and 7100 < age < 7300
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute("DELETE FROM staged_jobs_dead")
            conn.execute("DELETE FROM staged_jobs WHERE ordering_key = 'a'")
        leader.refresh_figures(force=True)
        assert gauge(leader, "drain_blocked_keys") == gauge(leader, "drain_oldest_blocked_age_seconds") == 0
    finally:
        leader.shutdown()


def test_dead_list_shows_each_dead_letters_key(database: str, held: dict[str, int]) -> None:
    add(database, "unkeyed", None)
    bury(database, "unkeyed")
    lines = command(["dead", "list", "--dsn", database]).splitlines()
    assert [line.split("\t")[2:5] for line in lines] == [
        ["c1", "default/default", 'key="c"'],
        ["unkeyed", "default/default", "key=none"],
    ]
    listed = json.loads(command(["dead", "list", "--json", "--dsn", database]))
    assert [(row["job_name"], row["ordering_key"]) for row in listed] == [("c1", "c"), ("unkeyed", None)]


PARKED_IN_PLACE = "drain: parked in place: the table refused its DELETE"


@pytest.mark.parametrize("holder", ["retry", "parked", "dead letter"])
def test_a_held_key_never_keeps_the_leader_awake(
    settings: config.Settings, database: str, clock: ManualClock, holder: str
) -> None:
    """Rows are due, none is selectable: the leader must sleep (armed, with the wake-up), never
    take "due" for "an app locks it" and look again at once."""
    add(database, "a1", "a")
    add(database, "a2", "a")
    with psycopg.connect(database, autocommit=True) as conn:
        if holder == "retry":  # rejected, its next try an hour away
            conn.execute("UPDATE staged_jobs SET run_at = now() + interval '1 hour' WHERE job_name = 'a1'")
        elif holder == "parked":
            conn.execute("UPDATE staged_jobs SET last_error = %s WHERE job_name = 'a1'", (PARKED_IN_PLACE,))
    if holder == "dead letter":
        bury(database, "a1")
    memory = testing.MemoryAdapter("default")
    leader = relays.leading(
        settings,
        {"default": memory},
        clock,
        block_on_dead_letter=True,
        poll_min_s=0.5,
        poll_max_s=5.0,
        wakeup_poll_max_s=10.0,
    )
    try:
        waits = []
        for _ in range(6):
            waits.append(leader.turn())
            assert leader.wakeup is not None and leader.wakeup.armed, f"turn {len(waits)}: not asleep, armed"
            clock.advance(waits[-1])
        assert memory.published == []
        assert min(waits) >= 0.5 * 0.75, waits  # the idle poll (jitter 0.5: 0.75 of each wait)
        assert waits == sorted(waits), waits  # backing off, as for an empty table
        assert not leader.store.anything_due().now
    finally:
        leader.shutdown()


def test_a_key_chain_in_a_pipelined_loop_goes_on_at_once(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    """The step that collects a keyed row's confirm selects nothing (the next row of its key was
    held by it), yet its settlement freed that row: the loop looks again at once."""
    ids = [add(database, f"a{n}", "a") for n in range(4)]
    memory = testing.PipelinedMemoryAdapter("default")
    leader = relays.leading(settings, {"default": memory}, clock, pipeline_depth=2)
    try:
        waits = []
        while len(memory.published) < len(ids) and len(waits) < 20:
            waits.append(leader.turn())
        assert [job.id for job in memory.published] == ids
        assert waits == [0.0] * len(waits), waits
    finally:
        leader.shutdown()
