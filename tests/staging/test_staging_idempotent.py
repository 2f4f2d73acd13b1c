"""on_conflict="ignore": a caller-chosen job_id already staged is not staged twice, and the caller
learns which happened. The id is unique while staged; once forwarded it can be staged anew."""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest

import drain
from tests.support.waiting import wait_until


def job_ids(dsn: str) -> list[uuid.UUID]:
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute("SELECT job_id FROM staged_jobs ORDER BY id")]


def test_stage_returns_a_uuid_without_on_conflict(database: str) -> None:
    with psycopg.connect(database) as conn:
        assert isinstance(drain.stage(conn, "app.tasks.a"), uuid.UUID)


def test_a_retried_request_does_not_double_the_job(database: str) -> None:
    key = uuid.uuid4()
    with psycopg.connect(database) as conn:
        first = drain.stage(conn, "app.tasks.a", job_id=key, on_conflict="ignore")
    with psycopg.connect(database) as conn:
        again = drain.stage(conn, "app.tasks.a", job_id=str(key), on_conflict="ignore")
        conn.execute("SELECT 1")  # the transaction is still usable
    assert first == drain.Staged(key, staged=True)
    assert again == drain.Staged(key, staged=False)
    assert job_ids(database) == [key]


def test_without_on_conflict_a_duplicate_still_raises(database: str) -> None:
    key = uuid.uuid4()
    with psycopg.connect(database) as conn:
        drain.stage(conn, "app.tasks.a", job_id=key)
        with pytest.raises(psycopg.errors.UniqueViolation):
            drain.stage(conn, "app.tasks.a", job_id=key)


def test_stage_many_reports_each_job(database: str) -> None:
    old, new = uuid.uuid4(), uuid.uuid4()
    with psycopg.connect(database) as conn:
        drain.stage(conn, "app.tasks.a", job_id=old)
    with psycopg.connect(database) as conn:
        results = drain.stage_many(
            conn,
            [drain.Job("app.tasks.b", job_id=old), drain.Job("app.tasks.c", job_id=new),
             {"job_name": "app.tasks.d", "job_id": new}, drain.Job("app.tasks.e")],
            on_conflict="ignore",
        )  # fmt: skip
    assert [(r.job_id, r.staged) for r in results[:3]] == [(old, False), (new, True), (new, False)]
    assert results[3].staged
    assert job_ids(database) == [old, new, results[3].job_id]


def test_stage_many_refuses_a_repeated_id_without_on_conflict(database: str) -> None:
    key = uuid.uuid4()
    with psycopg.connect(database) as conn:
        with pytest.raises(drain.StagingError, match=r"job 1: job_id .* repeats job 0"):
            drain.stage_many(conn, [drain.Job("a.b", job_id=key), drain.Job("a.c", job_id=key)])
        conn.execute("SELECT 1")  # refused before sending: the transaction is usable


def test_a_concurrent_uncommitted_stage_decides_by_its_outcome(database: str) -> None:
    """The second INSERT waits for the first transaction: staged=False if it commits, True if not."""

    def second(key: uuid.UUID, results: list[drain.Staged]) -> None:
        with psycopg.connect(database) as conn:
            results.append(drain.stage(conn, "app.tasks.a", job_id=key, on_conflict="ignore"))

    for first_commits in (True, False):
        key = uuid.uuid4()
        results: list[drain.Staged] = []
        with psycopg.connect(database) as first:
            drain.stage(first, "app.tasks.a", job_id=key)
            thread = threading.Thread(target=second, args=(key, results))
            thread.start()
            wait_until("the second INSERT to wait on the first", lambda: waiting(database), 10)
            if first_commits:
                first.commit()
            else:
                first.rollback()
        thread.join(timeout=30)
        assert results == [drain.Staged(key, staged=not first_commits)]
        assert job_ids(database)[-1:] == [key]


def waiting(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ).fetchone()
    return bool(row and row[0])


def test_once_forwarded_the_id_can_be_staged_again(database: str) -> None:
    key = uuid.uuid4()
    with psycopg.connect(database) as conn:
        drain.stage(conn, "app.tasks.a", job_id=key)
    with psycopg.connect(database) as conn:
        conn.execute("DELETE FROM staged_jobs WHERE job_id = %s", (key,))  # what the drain does
    with psycopg.connect(database) as conn:
        assert drain.stage(conn, "app.tasks.a", job_id=key, on_conflict="ignore").staged


def test_on_conflict_values(database: str) -> None:
    with (
        psycopg.connect(database) as conn,
        pytest.raises(drain.StagingError, match='on_conflict must be None or "ignore"'),
    ):
        drain.stage(conn, "app.tasks.a", on_conflict="update")  # type: ignore[call-overload]


@pytest.mark.parametrize("kind", ["psycopg2", "psycopg2_cursor", "sqlalchemy"])
def test_on_conflict_ignore_on_other_drivers(database: str, kind: str) -> None:
    import psycopg2
    import sqlalchemy

    key = uuid.uuid4()
    jobs = [drain.Job("app.tasks.a", job_id=key), drain.Job("app.tasks.b")]
    if kind.startswith("psycopg2"):
        conn = psycopg2.connect(database)
        target = conn.cursor() if kind.endswith("cursor") else conn
        first = drain.stage(target, "app.tasks.a", job_id=key, on_conflict="ignore")
        again = drain.stage_many(target, jobs, on_conflict="ignore")
        conn.commit()
        conn.close()
    else:
        engine = sqlalchemy.create_engine(database.replace("postgresql://", "postgresql+psycopg2://", 1))
        with engine.begin() as sa_conn:
            first = drain.stage(sa_conn, "app.tasks.a", job_id=key, on_conflict="ignore")
            again = drain.stage_many(sa_conn, jobs, on_conflict="ignore")
        engine.dispose()
    assert first == drain.Staged(key, staged=True)
    assert [r.staged for r in again] == [False, True]
    assert len(job_ids(database)) == 2
