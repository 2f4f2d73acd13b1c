"""drain.cli.database.connected: every command's session is closed, and a psycopg error is one line."""

from __future__ import annotations

import psycopg
import pytest

from drain import errors
from drain.cli import database


class Session:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_psycopg_error_becomes_one_line_and_the_session_is_closed() -> None:
    session = Session()
    with pytest.raises(errors.DrainError) as raised, database.connected(session) as used:
        assert used is session
        raise psycopg.errors.InsufficientPrivilege("permission denied for table staged_jobs\nDETAIL: more")
    assert str(raised.value) == "database error: permission denied for table staged_jobs"
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert session.closed == 1


def test_other_errors_pass_unchanged_and_a_clean_exit_closes_too() -> None:
    session = Session()
    schema = errors.SchemaError("table public.staged_jobs does not exist; run `drain migrate`")
    with pytest.raises(errors.SchemaError) as raised, database.connected(session):
        raise schema
    assert raised.value is schema and session.closed == 1
    with database.connected(session):
        pass
    assert session.closed == 2


def test_closing_calls_any_close() -> None:
    closed: list[bool] = []
    with (
        pytest.raises(errors.DrainError, match=r"^database error: gone$"),
        database.closing(lambda: closed.append(True)),
    ):
        raise psycopg.OperationalError("gone")
    assert closed == [True]
