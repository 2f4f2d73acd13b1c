"""The one way a command holds a database session: opened, used, closed, its errors in one line."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

import psycopg

from drain import errors


class _Closable(Protocol):
    def close(self) -> None: ...


Session = TypeVar("Session", bound=_Closable)


def database_error(exc: Exception) -> errors.DrainError:
    """A psycopg error as the one line a command prints (exit 1): ``database error: ...``."""
    return errors.DrainError(f"database error: {errors.first_line(exc)}")


@contextlib.contextmanager
def closing(close: Callable[[], object]) -> Iterator[None]:
    """Call ``close`` on the way out, whatever happens; a psycopg error becomes database_error."""
    try:
        yield
    except psycopg.Error as exc:
        raise database_error(exc) from None
    finally:
        close()


@contextlib.contextmanager
def connected(session: Session) -> Iterator[Session]:
    """Use ``session`` (a Store, a connection) for one command and close it on the way out.

    A Store connects on its first statement: a connection that fails raises DrainError there.
    A psycopg error on the way becomes the one line ``database error: ...`` (DrainError).
    """
    with closing(session.close):
        yield session
