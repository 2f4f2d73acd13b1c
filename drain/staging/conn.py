"""Run a staging statement on whatever connection the app handed over, inside its transaction.

Sync: a psycopg 3 connection or cursor, a psycopg2 connection or cursor, a SQLAlchemy 2
``Connection`` or ORM ``Session`` (psycopg or psycopg2 driver), a Django connection or cursor.
The async kinds are in :mod:`drain.staging.aio`. No driver is imported: each kind is recognised
by what it offers, and all of them take the same ``%(name)s`` statement text.

An async connection handed to the sync API is refused at once: calling its ``execute`` would
make a coroutine that nobody awaits, and the job would be lost while an id came back.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from drain import errors

PYFORMAT = "pyformat"
# libpq PQtransactionStatus: INTRANS and INERROR, a transaction block is open.
IN_TRANSACTION = (2, 3)


class AutocommitWarning(UserWarning):
    """A job was staged on a connection in autocommit mode: it was committed on its own, at once,
    not together with the app's other writes. Python's default filter shows it once per call
    site; ``warnings.filterwarnings("error", category=drain.AutocommitWarning)`` makes it an error."""


def is_async(cls: type) -> bool:
    """Whether instances of ``cls`` are asyncio connections, cursors or sessions (their
    statements are coroutines)."""
    for method in ("execute", "exec_driver_sql"):
        if inspect.iscoroutinefunction(getattr(cls, method, None)):
            return True
    return False


def warn_if_autocommit(driver: Any, stacklevel: int) -> None:
    """Warn when the DB-API connection under the app's object commits every statement on its own:
    autocommit mode, and no transaction block opened explicitly (psycopg's ``transaction()``,
    a ``BEGIN``) — libpq's transaction status tells the two apart for psycopg 3 and psycopg2."""
    if getattr(driver, "autocommit", False) is not True:
        return
    info = getattr(driver, "info", None)
    status = getattr(info, "transaction_status", None)
    if status is not None and int(status) in IN_TRANSACTION:
        return
    warnings.warn(
        "drain: staged on a connection in autocommit mode, so the job was committed on its own "
        "(not with the rest of your transaction); open a transaction to stage atomically",
        AutocommitWarning,
        stacklevel=stacklevel + 1,
    )


@functools.cache
def kind_of(cls: type) -> str:
    """Which kind of connection a class is, decided once per class (staging is a hot path)."""
    if is_async(cls):
        return "async"
    if hasattr(cls, "get_bind") and callable(getattr(cls, "connection", None)):
        return "sqlalchemy_session"
    if hasattr(cls, "exec_driver_sql"):
        return "sqlalchemy_connection"
    if hasattr(cls, "get_autocommit"):
        return "django_connection"
    if hasattr(cls, "execute") and (hasattr(cls, "fetchall") or cls.__module__.startswith("django.db")):
        return "cursor"  # Django's CursorWrapper hands fetchall on to the driver's cursor
    if hasattr(cls, "execute"):
        return "psycopg_connection"
    if hasattr(cls, "cursor"):
        return "psycopg2_connection"
    return "unknown"


def execute(conn: Any, statement: str, params: Mapping[str, Any], returning: bool) -> list[Sequence[Any]]:
    """Run ``statement`` on ``conn``; return its rows when ``returning``. The caller's
    transaction is used as it is: nothing here begins, commits or rolls back."""
    kind = kind_of(conn.__class__)
    if kind == "async":
        raise errors.StagingError(
            f"{type(conn).__name__} is an asyncio connection: use `await drain.astage(...)` "
            "(drain.stage would create a coroutine nobody awaits and stage nothing)"
        )
    if kind == "sqlalchemy_session":
        conn = conn.connection()
        kind = "sqlalchemy_connection"
    if kind == "sqlalchemy_connection":
        require_pyformat(conn.dialect)
        warn_if_autocommit(conn.connection.driver_connection, stacklevel=3)
        result = conn.exec_driver_sql(statement, dict(params))
        return list(result.fetchall()) if returning else []
    if kind == "django_connection":
        if conn.get_autocommit():
            warn_if_autocommit(_AUTOCOMMIT, stacklevel=3)
        with conn.cursor() as cursor:
            cursor.execute(statement, params)
            return list(cursor.fetchall()) if returning else []
    if kind == "cursor":  # a cursor of any of them
        _warn_for_cursor(conn)
        _never_awaitable(conn.execute(statement, params))
        return list(conn.fetchall()) if returning else []
    if kind == "psycopg_connection":
        warn_if_autocommit(conn, stacklevel=3)
        cursor = _never_awaitable(conn.execute(statement, params))
        return list(cursor.fetchall()) if returning else []
    if kind == "psycopg2_connection":
        warn_if_autocommit(conn, stacklevel=3)
        cursor = conn.cursor()
        try:
            cursor.execute(statement, params)
            return list(cursor.fetchall()) if returning else []
        finally:
            cursor.close()
    raise errors.StagingError(f"cannot stage on a {type(conn).__name__}: not a database connection")


def require_pyformat(dialect: Any) -> None:
    """drain's statements use ``%(name)s`` parameters: the psycopg and psycopg2 drivers."""
    if getattr(dialect, "paramstyle", None) != PYFORMAT:
        raise errors.StagingError(
            f"cannot stage through the SQLAlchemy driver {getattr(dialect, 'driver', '?')!r}: drain "
            "supports the psycopg and psycopg2 drivers (postgresql+psycopg://, postgresql+psycopg2://)"
        )


class _Autocommitting:
    autocommit = True


_AUTOCOMMIT = _Autocommitting()


def _warn_for_cursor(cursor: Any) -> None:
    db = getattr(cursor, "db", None)  # a Django CursorWrapper
    if db is not None and hasattr(db, "get_autocommit"):
        if db.get_autocommit():
            warn_if_autocommit(_AUTOCOMMIT, stacklevel=4)
        return
    warn_if_autocommit(getattr(cursor, "connection", None), stacklevel=4)


def _never_awaitable(result: Any) -> Any:
    """The net behind is_async: an awaitable result means nothing was sent, so say so."""
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if callable(close):
            close()
        raise errors.StagingError(
            "the connection returned an awaitable: it is an asyncio connection, use `await drain.astage(...)`"
        )
    return result
