"""A burial never fails on what the dead-letter table already holds, nor on the row (G6).

On drain 0.1.0's schema the dead letters were keyed by the staged row's id: once the table's
identity restarted, or a row came back with its id (a restored table), burying a row whose id was
already dead failed, the batch rolled back, and the rows behind it went to the broker again on
every step. So did a row staged with ``attempts`` at the integer maximum (``attempts + 1``
overflowed) and a rejection whose message held a NUL or a lone surrogate (which a text column
refuses). Each case buries the row and forwards the good rows behind it, with the in-memory
backend, on the current schema; ``drain dead`` keeps working by the dead letters' own ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import psycopg
import pytest

import drain
from drain import cli, config, models, testing
from drain.relay import loop as relay
from tests.conftest import ManualClock
from tests.support import relays

POISON = "app.poison"


@pytest.fixture
def memory() -> testing.MemoryAdapter:
    adapter = testing.MemoryAdapter("default")
    adapter.behaviour = lambda job: "reject" if job.job_name == POISON else "ack"
    return adapter


def stage_poison_then_good(dsn: str, good: int = 3) -> None:
    """A poison row on its last attempt (the relays' max_attempts is 3), then good rows."""
    with psycopg.connect(dsn) as conn:
        drain.stage(conn, POISON)
        drain.stage_many(conn, [drain.Job("app.good", args=[n]) for n in range(good)])
        conn.execute("UPDATE staged_jobs SET attempts = 2 WHERE job_name = %s", (POISON,))


def dead(dsn: str) -> list[tuple[int, int, str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT dead_id, id, error FROM staged_jobs_dead ORDER BY dead_id").fetchall()
    return [(int(a), int(b), str(c)) for a, b, c in rows]


def bury_one(leader: relay.Relay, memory: testing.MemoryAdapter, dsn: str, good: int = 3) -> None:
    before = len(memory.published)
    report = leader.drain_once()  # on drain 0.1.0's schema: UniqueViolation, the batch rolled back
    assert (report.dead, report.published) == (1, good)
    assert len(memory.published) == before + good
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM staged_jobs").fetchone() == (0,)


@pytest.mark.parametrize(
    "reuse",
    [
        "ALTER TABLE staged_jobs ALTER COLUMN id RESTART WITH 1",  # the identity restarted
        "TRUNCATE staged_jobs RESTART IDENTITY",
    ],
)
def test_a_row_whose_id_is_already_dead_is_buried(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str, reuse: str
) -> None:
    stage_poison_then_good(database)
    bury_one(leader, memory, database)
    with psycopg.connect(database) as conn:
        conn.execute(reuse)  # type: ignore[arg-type]
    stage_poison_then_good(database)  # the poison row gets id 1 again
    bury_one(leader, memory, database)
    ((first, row_a, _), (second, row_b, _)) = dead(database)
    assert row_a == row_b == 1 and first < second


def test_a_restored_row_keeps_its_dead_id_and_is_buried_again(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    stage_poison_then_good(database, good=0)
    bury_one(leader, memory, database, good=0)
    with psycopg.connect(database) as conn:  # a backup of the table restored, ids and all
        conn.execute(
            "INSERT INTO staged_jobs (id, job_name, job_id, attempts) OVERRIDING SYSTEM VALUE "
            "SELECT id, job_name, gen_random_uuid(), 2 FROM staged_jobs_dead"
        )
    bury_one(leader, memory, database, good=0)
    assert [row_id for _, row_id, _ in dead(database)] == [1, 1]


def test_a_row_at_the_integer_maximum_of_attempts_is_buried(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str
) -> None:
    stage_poison_then_good(database)
    with psycopg.connect(database) as conn:
        conn.execute("UPDATE staged_jobs SET attempts = 2147483647 WHERE job_name = %s", (POISON,))
    bury_one(leader, memory, database)  # 0.1.0: integer out of range
    with psycopg.connect(database) as conn:
        assert conn.execute("SELECT attempts FROM staged_jobs_dead").fetchone() == (2147483647,)


class Garbling(testing.MemoryAdapter):
    """Rejects the poison row with an error a text column cannot hold as it is."""

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        return [
            models.PublishResult.rejected(job, "broker said \x00 and \ud800")
            if job.job_name == POISON
            else models.PublishResult.published(job)
            for job in jobs
        ]


def test_an_error_with_a_nul_or_a_lone_surrogate_is_recorded_and_buried(
    settings: config.Settings, database: str, clock: ManualClock
) -> None:
    leader = relays.leading(settings, {"default": Garbling("default")}, clock)
    try:
        with psycopg.connect(database) as conn:
            drain.stage(conn, POISON)
        assert leader.drain_once().rejected == 1  # a retry: last_error recorded (0.1.0: DataError)
        with psycopg.connect(database) as conn:
            assert conn.execute("SELECT last_error FROM staged_jobs").fetchone() == (
                "broker said \\x00 and \\ud800",
            )
            conn.execute("UPDATE staged_jobs SET attempts = 2, run_at = NULL")
        assert leader.drain_once().dead == 1
        assert [error for _, _, error in dead(database)] == ["broker said \\x00 and \\ud800"]
    finally:
        leader.shutdown()


def test_drain_dead_works_by_the_dead_letters_own_ids(
    leader: relay.Relay, memory: testing.MemoryAdapter, database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for _ in range(2):  # the same row id dead twice
        stage_poison_then_good(database, good=0)
        bury_one(leader, memory, database, good=0)
        with psycopg.connect(database) as conn:
            conn.execute("TRUNCATE staged_jobs RESTART IDENTITY")
    argv = ["--dsn", database]
    assert cli.main(["dead", "list", "--json", *argv], env={}) == cli.EXIT_OK
    listed = json.loads(capsys.readouterr().out)
    assert [row["row_id"] for row in listed] == [1, 1]
    first, second = (row["id"] for row in listed)
    assert first != second
    assert cli.main(["dead", "retry", "--id", str(second), *argv], env={}) == cli.EXIT_OK
    assert "1 dead letter(s) staged again" in capsys.readouterr().out
    assert [dead_id for dead_id, _, _ in dead(database)] == [first]  # only that one moved
    with psycopg.connect(database) as conn:
        conn.execute("UPDATE staged_jobs SET attempts = 2")
    bury_one(leader, memory, database, good=0)  # buried again: a new dead letter
    assert len(dead(database)) == 2 and dead(database)[-1][0] > second
    assert cli.main(["dead", "purge", "--id", str(first), *argv], env={}) == cli.EXIT_OK
    (left,) = dead(database)
    assert left[0] > second


def test_drain_dead_retry_leaves_the_dead_letters_the_table_refuses(
    database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with psycopg.connect(database) as conn:  # one buried before the constraints, one fine
        conn.execute(
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id, "
            "options, created_at, attempts, error) VALUES "
            "(1, 'app.fine', '[]', '{}', 'q', 'default', gen_random_uuid(), '{}', now(), 3, 'e'), "
            "(2, 'app.blank', '[]', '{}', ' ', 'default', gen_random_uuid(), '{}', now(), 3, 'e')"
        )
    assert cli.main(["dead", "retry", "--dsn", database], env={}) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert "1 dead letter(s) staged again" in out
    assert err.startswith("drain: 1 dead letter(s) left: the table refuses them") and err.count("\n") == 1
    with psycopg.connect(database) as conn:
        assert conn.execute("SELECT job_name FROM staged_jobs").fetchall() == [("app.fine",)]
        assert conn.execute("SELECT job_name FROM staged_jobs_dead").fetchall() == [("app.blank",)]
