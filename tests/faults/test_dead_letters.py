"""Dead letters end to end: rows the backend keeps rejecting are buried with their error, and
``drain dead list|retry|purge`` show them, stage them again (new row, same job_id) and delete them.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator

import psycopg
import pytest

import drain
from drain import cli, config, testing
from drain.relay import loop as relay

MAX_ATTEMPTS = 2


@pytest.fixture
def memory() -> testing.MemoryAdapter:
    adapter = testing.MemoryAdapter("default")
    adapter.behaviour = lambda job: "reject" if job.job_name.startswith("app.bad") else "ack"
    return adapter


@pytest.fixture
def leader(settings: config.Settings, memory: testing.MemoryAdapter) -> Iterator[relay.Relay]:
    settings = dataclasses.replace(
        settings,
        retry_base_s=0.0,
        retry_max_s=0.0,
        backends={"default": config.BackendSettings("default", "memory", MAX_ATTEMPTS, {})},
    )
    the_relay = relay.Relay(settings, {"default": memory}, jitter=lambda: 0.0)
    assert the_relay.leadership.try_acquire()
    yield the_relay
    the_relay.shutdown()


def drain_to_empty(leader: relay.Relay) -> None:
    for _ in range(50):
        if not leader.drain_once().selected:
            return
    raise AssertionError("the table never emptied")


def run_cli(database: str, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(["dead", *argv, "--dsn", database], env={})
    return code, capsys.readouterr().out


def stage_all(database: str) -> dict[str, uuid.UUID]:
    jobs = {
        "good": drain.Job("app.good", args=[1]),
        "bad_a": drain.Job("app.bad_a", args=[2], queue="mail"),
        "bad_b": drain.Job("app.bad_b", kwargs={"k": "v"}, backend="default"),
    }
    with psycopg.connect(database) as conn:
        ids = drain.stage_many(conn, list(jobs.values()))
    return dict(zip(jobs, ids, strict=True))


def test_rejected_rows_are_buried_listed_retried_and_purged(
    leader: relay.Relay,
    memory: testing.MemoryAdapter,
    database: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    staged = stage_all(database)
    drain_to_empty(leader)
    assert [job.job_id for job in memory.published] == [staged["good"]]

    code, out = run_cli(database, capsys, "list", "--json")
    dead = json.loads(out)
    assert code == 0
    assert [row["job_id"] for row in dead] == [str(staged["bad_a"]), str(staged["bad_b"])]
    assert all(row["attempts"] == MAX_ATTEMPTS and row["error"] == "memory: rejected" for row in dead)
    assert dead[0]["queue"] == "mail" and dead[0]["args"] == [2] and dead[1]["kwargs"] == {"k": "v"}

    code, out = run_cli(database, capsys, "list", "--queue", "mail")
    assert code == 0 and out.count("\n") == 1 and "app.bad_a" in out and "memory: rejected" in out
    assert json.loads(run_cli(database, capsys, "list", "--json", "--job-name", "nope")[1]) == []

    # Retry one by id once the backend accepts it: a new row, the same job_id, delivered.
    memory.behaviour = lambda job: "ack"
    code, out = run_cli(database, capsys, "retry", "--id", str(dead[0]["id"]))
    assert code == 0 and "1 dead letter(s) staged again" in out
    with psycopg.connect(database) as conn:
        row = conn.execute("SELECT id, job_id, attempts, run_at, last_error FROM staged_jobs").fetchone()
    assert row is not None and row[0] != dead[0]["id"]
    assert (row[1], row[2], row[3], row[4]) == (staged["bad_a"], 0, None, None)
    drain_to_empty(leader)
    assert memory.published[-1].job_id == staged["bad_a"]

    # Purge everything needs --yes; a filter that matches nothing deletes nothing.
    assert run_cli(database, capsys, "purge")[0] == cli.EXIT_NOT_CONFIRMED
    assert run_cli(database, capsys, "purge", "--backend", "other")[1].startswith("drain: 0 dead")
    code, out = run_cli(database, capsys, "purge", "--yes")
    assert code == 0 and "1 dead letter(s) purged" in out
    assert json.loads(run_cli(database, capsys, "list", "--json")[1]) == []


def test_retry_all_keeps_a_dead_letter_whose_job_id_is_staged_again(
    leader: relay.Relay, database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    staged = stage_all(database)
    drain_to_empty(leader)
    with psycopg.connect(database) as conn:  # the app staged bad_b again under the same job_id
        drain.stage(conn, "app.bad_b", job_id=staged["bad_b"], run_at=None, delay=3600)
    code, out = run_cli(database, capsys, "retry")
    assert code == 0 and "1 dead letter(s) staged again" in out
    remaining = json.loads(run_cli(database, capsys, "list", "--json")[1])
    assert [row["job_id"] for row in remaining] == [str(staged["bad_b"])]
    with psycopg.connect(database) as conn:
        job_ids = {r[0] for r in conn.execute("SELECT job_id FROM staged_jobs").fetchall()}
    assert job_ids == {staged["bad_a"], staged["bad_b"]}


def test_dead_commands_need_the_table(database: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["dead", "list", "--dsn", database, "--table", "missing"], env={})
    err = capsys.readouterr().err
    assert code == cli.EXIT_FAILURE and "drain migrate" in err and err.count("\n") == 1
