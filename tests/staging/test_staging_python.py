"""Every sync Python stack: psycopg 3, psycopg2, SQLAlchemy 2 Connection and ORM Session.

Each test proves the three staging guarantees end to end (tests.stacks.harness): invisible to a
drain until commit, committed → delivered by a real RQ worker, rolled back → never.
"""

from __future__ import annotations

import warnings

import psycopg
import psycopg2
import pytest
import sqlalchemy
from sqlalchemy import orm

import drain
from tests.stacks.harness import COMMITTED, ROLLED_BACK, StackRig, stack_fixture  # noqa: F401
from tests.support import tasks


def sa_url(dsn: str, driver: str) -> str:
    return dsn.replace("postgresql://", f"postgresql+{driver}://", 1)


def test_psycopg_connection(stack: StackRig) -> None:
    with psycopg.connect(stack.dsn) as conn:
        drain.stage(conn, tasks.record, args=[COMMITTED], queue=stack.queue)
        stack.drain_sees_nothing()
        conn.commit()
        drain.stage(conn, tasks.record, args=[ROLLED_BACK], queue=stack.queue)
        conn.rollback()
    stack.only_committed_delivered()


def test_psycopg_cursor_in_a_transaction_block(stack: StackRig) -> None:
    with psycopg.connect(stack.dsn, autocommit=True) as conn:
        with conn.transaction(), conn.cursor() as cursor:
            drain.stage(cursor, "tests.support.tasks.record", args=[COMMITTED], queue=stack.queue)
            stack.drain_sees_nothing()
        with pytest.raises(RuntimeError), conn.transaction(), conn.cursor() as cursor:
            drain.stage(cursor, tasks.record, args=[ROLLED_BACK], queue=stack.queue)
            raise RuntimeError("the app fails after staging")
    stack.only_committed_delivered()


def test_psycopg2_connection(stack: StackRig) -> None:
    conn = psycopg2.connect(stack.dsn)
    try:
        drain.stage(conn, tasks.record, args=[COMMITTED], queue=stack.queue)
        stack.drain_sees_nothing()
        conn.commit()
        drain.stage_many(conn, [drain.Job(tasks.record, args=[ROLLED_BACK], queue=stack.queue)])
        conn.rollback()
    finally:
        conn.close()
    stack.only_committed_delivered()


def test_psycopg2_cursor(stack: StackRig) -> None:
    conn = psycopg2.connect(stack.dsn)
    try:
        with conn.cursor() as cursor:
            drain.stage_many(cursor, [drain.Job(tasks.record, args=[COMMITTED], queue=stack.queue)])
            stack.drain_sees_nothing()
        conn.commit()
        with conn.cursor() as cursor:
            drain.stage(cursor, tasks.record, args=[ROLLED_BACK], queue=stack.queue)
        conn.rollback()
    finally:
        conn.close()
    stack.only_committed_delivered()


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_sqlalchemy_connection(stack: StackRig, driver: str) -> None:
    engine = sqlalchemy.create_engine(sa_url(stack.dsn, driver))
    try:
        with engine.begin() as conn:
            drain.stage(conn, tasks.record, args=[COMMITTED], queue=stack.queue)
            stack.drain_sees_nothing()
        with engine.connect() as conn:
            drain.stage(conn, tasks.record, args=[ROLLED_BACK], queue=stack.queue)
            conn.rollback()
    finally:
        engine.dispose()
    stack.only_committed_delivered()


def test_sqlalchemy_orm_session(stack: StackRig) -> None:
    engine = sqlalchemy.create_engine(sa_url(stack.dsn, "psycopg"))
    try:
        with orm.Session(engine) as session, session.begin():
            session.execute(sqlalchemy.text("CREATE TABLE users (email text)"))
            session.execute(sqlalchemy.text("INSERT INTO users VALUES ('a@example.com')"))
            drain.stage(session, tasks.record, args=[COMMITTED], queue=stack.queue)
            stack.drain_sees_nothing()
        with orm.Session(engine) as session:
            drain.stage(session, tasks.record, args=[ROLLED_BACK], queue=stack.queue)
            session.rollback()
    finally:
        engine.dispose()
    stack.only_committed_delivered()


def test_autocommit_warns_that_the_job_committed_alone(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):
            drain.stage(conn, "app.tasks.a")  # one call site: one warning
    assert [w.category for w in seen] == [drain.AutocommitWarning]
    assert "committed on its own" in str(seen[0].message)
    assert seen[0].filename == __file__  # points at the app's line, not at drain
    with psycopg.connect(database) as conn, warnings.catch_warnings():
        warnings.simplefilter("error")
        drain.stage(conn, "app.tasks.a")  # in a transaction: no warning
    with psycopg.connect(database, autocommit=True) as conn, warnings.catch_warnings():
        warnings.simplefilter("error")
        with conn.transaction():
            drain.stage(conn, "app.tasks.a")  # autocommit, but inside a transaction block


@pytest.mark.parametrize("kind", ["psycopg2", "sqlalchemy"])
def test_autocommit_warns_on_other_drivers(database: str, kind: str) -> None:
    if kind == "psycopg2":
        conn = psycopg2.connect(database)
        conn.autocommit = True
        with pytest.warns(drain.AutocommitWarning):
            drain.stage(conn, "app.tasks.a")
        conn.close()
        return
    engine = sqlalchemy.create_engine(sa_url(database, "psycopg"), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn, pytest.warns(drain.AutocommitWarning):
        drain.stage(conn, "app.tasks.a")
    engine.dispose()


def test_sqlalchemy_driver_without_pyformat_is_refused() -> None:
    class Dialect:
        paramstyle = "numeric_dollar"
        driver = "asyncpg"

    class Conn:
        dialect = Dialect()

        def exec_driver_sql(self, *args: object) -> None:
            raise AssertionError("nothing may be sent")

    with pytest.raises(drain.StagingError, match="psycopg and psycopg2 drivers"):
        drain.stage(Conn(), "app.tasks.a")
