"""What a Redis error means for the drain, decided by where it arose, never by its wording.

The rule (docs/guarantees.md, "Whose fault is a refusal"):

- **The row's** only on positive evidence. Redis gives none in an error reply: a job's own
  key held by something else is found by the adapters before they write (RQ's ``HELD``), and
  its own data is checked while it is built. So no reply text ever rejects a row.
- **The queue's** when a write to the queue's own key is refused because that key holds
  another type (``WRONGTYPE``): every row of that queue would meet it. Its rows wait (RETRY,
  no attempt counted) and the relay paces that queue. :func:`wrong_type` is that evidence.
- **The backend's** for everything else: a replica, OOM, MISCONF, an ACL refusal of any kind
  (of a command, of the job's key, of a queue key), a shared key such as ``rq:queues`` of the
  wrong type, a lost connection, a reply nobody can place. The backend is unavailable: the
  rows stay untouched and nothing counts an attempt (G6, G10).

So a new Redis version's new wording can delay rows, never dead-letter them.
:func:`translated` is the adapters' one exception boundary around a whole call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis

from drain import errors

MAX_REASON_CHARS = 200
WRONGTYPE = "WRONGTYPE"
CLASS_CODES: tuple[tuple[type[BaseException], str], ...] = (
    # redis-py before 7.4 strips the code of the errors it maps to a class and sets no status_code
    (redis.exceptions.ReadOnlyError, "READONLY"),
    (redis.exceptions.OutOfMemoryError, "OOM"),  # type: ignore[attr-defined]  # not in types-redis
    (redis.exceptions.BusyLoadingError, "LOADING"),
    (redis.exceptions.NoScriptError, "NOSCRIPT"),
    (redis.exceptions.ExecAbortError, "EXECABORT"),
    (redis.exceptions.NoPermissionError, "NOPERM"),
)
PIPELINE_MARK = " of pipeline caused error: "
CLIENT_REPR_MARK = " : <redis."


def _text(error: str | BaseException) -> str:
    """The reply's text, without redis-py's pipeline annotation (which quotes the command and
    so the job's payload) nor the client reprs it appends to "No master found"."""
    text = str(error)
    text = text.split(PIPELINE_MARK, 1)[1] if PIPELINE_MARK in text else text
    return text.split(CLIENT_REPR_MARK, 1)[0]


def code(error: str | BaseException) -> str:
    """The error's leading code (``READONLY``), or ``""`` when it has none. redis-py strips the
    code of the errors it maps to a class of its own and keeps it as ``status_code`` (since 7.4;
    before, only the class says it: CLASS_CODES)."""
    status = getattr(error, "status_code", None)
    if isinstance(status, str) and status:
        return status
    for kind, name in CLASS_CODES:  # redis-py before 7.4
        if isinstance(error, kind):
            return name
    words = _text(error).lstrip("-").split(None, 1)
    word = words[0] if words else ""
    return word if word.isupper() and word.isalpha() else ""


def wrong_type(error: str | BaseException) -> bool:
    """Whether Redis refused a write because its key holds another type: the key's fault, to be
    blamed on whoever owns the key the caller wrote (a queue's key: that queue)."""
    return code(error) == WRONGTYPE


def reason(error: str | BaseException) -> str:
    """The reply as one bounded line, code first (Redis never echoes a password in an error)."""
    text = _text(error).strip()
    found = code(error)
    if found and not text.startswith(found):
        text = f"{found} {text}"
    return errors.first_line(Exception(text))[:MAX_REASON_CHARS]


def unavailable(label: str, error: str | BaseException, key: str | None = None) -> errors.BackendUnavailable:
    """The backend is unavailable because Redis refused a write (of ``key``, when known)."""
    where = f" of {key[:100]!r}" if key else ""
    return errors.BackendUnavailable(f"{label} refused the write{where}: {reason(error)}")


@contextlib.contextmanager
def translated(label: str) -> Iterator[None]:
    """The adapters' one exception boundary around a whole call to Redis.

    A lost, refused or timed-out connection (with redis-py's LOADING, authentication and
    Sentinel's "no master found", which it raises as connection errors) and every error reply
    for the whole call become BackendUnavailable, with no URL and no secret: an error of a
    whole call names no row.
    """
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise errors.BackendUnavailable(f"{label}: {type(exc).__name__}: {reason(exc)}") from None
    except redis.ResponseError as exc:
        raise unavailable(label, exc) from None
