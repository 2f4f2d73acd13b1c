"""Errors raised by drain.

One root, so an application can catch everything drain raises with one clause::

    DrainError
    ├── ConfigError          a setting is missing or invalid (the message names every problem)
    ├── StagingError         stage()/stage_many() was given an argument it cannot store
    ├── SchemaError          the staged-jobs table is missing or not the shape drain expects
    ├── LeadershipLost       the leader's lock session is gone or is not the one holding the lock
    │   └── PoolerDetected   the connection goes through a transaction-pooling proxy
    ├── CannotSettle         the drain cannot delete what it publishes there, for longer than its bound
    ├── SettlementRefused    the table refused the settlement of every row of a step (and of the rows probed)
    ├── SelectAgain          a select through the lanes index failed; the next one walks
    ├── BackendUnavailable   a whole backend cannot be reached; nothing of the batch is lost
    └── JobRefused           one job cannot become a message for its backend (that row's rejection)

Each class's docstring is its default message.
"""

from __future__ import annotations


class DrainError(Exception):
    """drain failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigError(DrainError):
    """The configuration is invalid."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class StagingError(DrainError, ValueError):
    """The job cannot be staged."""


class SchemaError(DrainError):
    """The staged-jobs table is missing; run `drain migrate`."""


class LeadershipLost(DrainError):
    """This drain no longer holds the leader lock."""


class PoolerDetected(LeadershipLost):
    """The database session changed between statements: a transaction-pooling proxy is in the way."""


class CannotSettle(DrainError):
    """The drain cannot settle (delete) what it would publish on the database it reaches."""


class SettlementRefused(DrainError):
    """The table refused the settlement of every row of a step, and of the other due rows probed."""


class SelectAgain(DrainError):
    """A select through the lanes index failed for a reason of its own; the next one walks."""


class BackendUnavailable(DrainError):
    """The backend cannot be reached."""


class JobRefused(DrainError):
    """The backend cannot accept this job."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name: for one-line logs and errors
    (libpq and others put hints and context on the lines after)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
