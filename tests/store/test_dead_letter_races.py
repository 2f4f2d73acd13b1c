"""`drain dead retry` and `drain dead purge` racing each other and the leader: each dead letter
is acted on once, and the loser says so in one line.

An independent review (issue 33, item 7) ran a retry and a purge of the same dead letters at
once: the loser failed with a raw serialization error (the CLI's session ran REPEATABLE READ).
Every pair of admin writes can race (retry/purge, retry/retry, purge/purge, either against the
leader burying more), so they all run READ COMMITTED and lock with SKIP LOCKED: a dead letter
another command holds is skipped and counted.

Counted over rounds of threads (each its own session) racing two retries and two purges while
rows are buried meanwhile: every dead letter ends exactly once staged again, purged, or still
dead; what the commands reported moving and purging is exactly what moved and went; none is
lost or staged twice. And a command that finds dead letters held by another skips them, exits 0
and says so in one line.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from drain import cli, config
from drain.cli import exit_codes
from drain.store import admin
from drain.store import session as store
from tests.support import configs

LETTERS = 40
ROUNDS = 5
BURIED_MEANWHILE = 10


def bury(conn: psycopg.Connection[Any], count: int) -> set[uuid.UUID]:
    """Dead letters as the leader writes them (one transaction, REPEATABLE READ): their job_ids."""
    job_ids = {uuid.uuid4() for _ in range(count)}
    with conn.transaction():
        for job_id in job_ids:
            conn.execute(
                "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
                " options, created_at, attempts, error)"
                " VALUES (nextval(pg_get_serial_sequence('staged_jobs', 'id')), 'json.dumps', '[]', '{}',"
                " 'default', 'default', %s, '{}', now(), 3, 'refused')",
                (job_id,),
            )
    return job_ids


def job_ids(conn: psycopg.Connection[Any], table: str) -> list[uuid.UUID]:
    return [row[0] for row in conn.execute(f"SELECT job_id FROM {table}").fetchall()]


def race(*actions: Callable[[], Any]) -> list[Any]:
    """Run every action at once on its own thread; their results (an exception fails the test)."""
    barrier = threading.Barrier(len(actions))
    results: list[Any] = [None] * len(actions)

    def run(index: int, action: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            results[index] = action()
        except BaseException as exc:
            results[index] = exc

    threads = [threading.Thread(target=run, args=item) for item in enumerate(actions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    failed = [result for result in results if isinstance(result, BaseException)]
    assert not failed, failed
    return results


def test_retries_purges_and_burials_racing_act_on_each_dead_letter_once(database: str) -> None:
    settings = config.Settings(dsn=database)
    sessions = [store.Store(settings) for _ in range(4)]
    commands = [admin.Admin(session.conn, session.names) for session in sessions]
    everything = admin.DeadFilter()
    with psycopg.connect(database, autocommit=True) as conn:
        leader = psycopg.connect(database, autocommit=True)
        leader.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        try:
            for _ in range(ROUNDS):
                created = bury(conn, LETTERS)
                retried_1, retried_2, purged_1, purged_2, buried = race(
                    lambda: commands[0].dead_retry(everything),
                    lambda: commands[1].dead_retry(everything),
                    lambda: commands[2].dead_purge(everything),
                    lambda: commands[3].dead_purge(everything),
                    lambda: bury(leader, BURIED_MEANWHILE),
                )
                created |= buried
                staged, dead = job_ids(conn, "staged_jobs"), job_ids(conn, "staged_jobs_dead")
                assert len(staged) == len(set(staged)) and len(dead) == len(set(dead))  # none twice
                assert not set(staged) & set(dead)  # none both staged and dead
                assert set(staged) | set(dead) <= created
                moved = retried_1.done + retried_2.done
                purged = purged_1.done + purged_2.done
                assert moved == len(staged)  # what they said they moved is what moved
                assert purged == len(created) - len(staged) - len(dead)  # ... and what went
                assert moved + purged > 0
                conn.execute("DELETE FROM staged_jobs")
                conn.execute("DELETE FROM staged_jobs_dead")
        finally:
            leader.close()
            for session in sessions:
                session.close()


@pytest.mark.parametrize("argv", [["retry"], ["purge", "--yes"]])
def test_a_command_skips_what_another_holds_and_says_so_in_one_line(
    database: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    cfg = configs.write_config(tmp_path / "drain.toml", database, {"default": configs.memory()})
    with psycopg.connect(database, autocommit=True) as conn:
        bury(conn, LETTERS)
    with psycopg.connect(database) as other:  # another command, mid-transaction on 10 of them
        other.execute("SELECT 1 FROM staged_jobs_dead ORDER BY dead_id LIMIT 10 FOR UPDATE").fetchall()
        code = cli.main(["dead", *argv, "--config", str(cfg), "--dsn", database], env={})
        out, err = capsys.readouterr()
    assert code == exit_codes.EXIT_OK, (out, err)
    assert not err and out.count("\n") == 1, (out, err)
    assert out.startswith(f"drain: {LETTERS - 10} dead letter(s)"), out
    assert "; 10 skipped: another command held them at the same time" in out, out
    with psycopg.connect(database) as conn:
        assert len(job_ids(conn, "staged_jobs_dead")) == 10  # the held ones, for the next command
