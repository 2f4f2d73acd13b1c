"""The console's sessions: reused while fresh, never handed out once the server may have cut them
(idle_session_timeout) or after a failure."""

from __future__ import annotations

import psycopg
import pytest

from drain import config
from tests.conftest import ManualClock

figures = pytest.importorskip("drain.console.figures")


def backend_pid(db: object) -> int:
    return int(db.conn.info.backend_pid)  # type: ignore[attr-defined]


def test_a_session_is_reused_while_fresh_and_replaced_once_stale(database: str, clock: ManualClock) -> None:
    sessions = figures.Sessions(config.Settings(dsn=database), clock=clock)
    with sessions.session() as db:
        first = backend_pid(db)
        row = db.conn.execute("SHOW application_name").fetchone()
        assert row is not None and row[0].startswith("drain-console/")  # not a standby to drain status
    with sessions.session() as db:
        assert backend_pid(db) == first
    clock.advance(sessions._idle_s)
    with sessions.session() as db:
        assert backend_pid(db) != first


def test_a_session_that_failed_is_not_handed_out_again(database: str, clock: ManualClock) -> None:
    sessions = figures.Sessions(config.Settings(dsn=database), clock=clock)
    with pytest.raises(psycopg.errors.UndefinedTable), sessions.session() as db:
        first = backend_pid(db)
        db.conn.execute("SELECT * FROM no_such_table")
    with sessions.session() as db:
        assert backend_pid(db) != first
        row = db.conn.execute("SHOW statement_timeout").fetchone()
        assert row is not None and row[0] == f"{figures.PAGE_TIMEOUT_MS // 1000}s"
