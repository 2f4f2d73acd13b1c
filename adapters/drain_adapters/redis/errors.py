"""What a Redis error means for the drain: the whole server refusing, or one job — decided once.

Redis starts every error reply with a code (``READONLY You can't write against a read only
replica.``). Some codes describe the server, whatever was asked: it is a replica, out of memory
under ``noeviction``, failing to persist (``MISCONF``), loading its dataset, busy with a script,
short of replicas for ``min-replicas-to-write``, a cluster node that is down or redirecting, or
the drain's credentials or ACL refuse the command itself. Those are :attr:`Scope.SERVER`: the
backend is unavailable, the rows wait untouched and nothing counts an attempt (G1, G6, G10).

A few codes are about the keys one job names: ``WRONGTYPE`` (its queue key holds another type)
and an ACL refusing a key (``NOPERM`` naming a key or channel). Those are :attr:`Scope.JOB`: that
row's rejection, never an outage a row could cause (G6).

Inside a script Redis words some of the same refusals with the generic ``ERR`` code, so the
code alone is not enough: the ACL refusing a command (7.0: ``ERR The user executing the script
can't run this command or subcommand``; 7.2+: ``ERR ACL failure in script: User u has no
permissions to run the 'rpush' command``), a command renamed away or not allowed from scripts,
a write refused to a read-only script, and Redis 6's ``ERR Error running script ...: OOM ...``
that wraps a server code in its text. Those texts are :attr:`Scope.SERVER` too
(:data:`SERVER_PHRASES`, and a known code embedded after a colon); an ACL refusal naming a key
or a channel in either wording is :attr:`Scope.JOB`.

Anything else is :attr:`Scope.UNKNOWN`, and where it appears decides: in the reply for one job
(an error inside a script or a transaction, the server having answered the others) it is that
job's rejection; as the error of a whole call it is an outage (nothing is dead-lettered for an
error nobody can pin on a row). :func:`translated` is the adapters' one exception boundary.
"""

from __future__ import annotations

import contextlib
import enum
import re
from collections.abc import Iterator

import redis

from drain import errors

MAX_REASON_CHARS = 200

SERVER_CODES = frozenset(
    {
        "READONLY",  # a replica (the old master after a failover, or REPLICAOF)
        "OOM",  # used memory above maxmemory with maxmemory-policy noeviction
        "MISCONF",  # stop-writes-on-bgsave-error, or the AOF cannot be written
        "LOADING",  # the dataset is being loaded into memory
        "BUSY",  # a script or function runs past busy-reply-threshold
        "MASTERDOWN",  # a replica lost its master, with replica-serve-stale-data no
        "NOREPLICAS",  # fewer good replicas than min-replicas-to-write
        "TRYAGAIN",  # a cluster slot is being migrated
        "CLUSTERDOWN",  # the cluster cannot serve the slot
        "MOVED",  # a cluster node redirecting: the drain does not speak Redis Cluster
        "ASK",
        "CROSSSLOT",
        "NOAUTH",  # the drain's credentials are refused
        "WRONGPASS",
        "NOPERM",  # the ACL refuses the command itself (a refused key is the job's: below)
        "NOSCRIPT",  # the script cache was flushed between redis-py's load and its call
        "EXECABORT",  # a transaction refused as a whole
        "UNBLOCKED",  # the instance changed role under a blocked call
        "DENIED",  # protected mode
    }
)
JOB_CODES = frozenset({"WRONGTYPE"})
KEY_WORDS = ("key", "channel")  # an ACL refusal naming one of these is about the job's keys
ACL_COMMAND_PHRASES = (  # an ACL refusal of the command itself, whatever its code: the server's
    "can't run this command",  # inside a script, Redis 7.0
    "no permissions to run the",  # NOPERM; inside a script, Redis 7.2+ ("ACL failure in script")
    "lacking the permissions for the command",  # inside a script, Redis 7.0, any other ACL reason
)
ACL_PHRASES = ("permission", "the user executing the script can't", "acl failure")
SERVER_PHRASES = (  # refusals of every write whatever the job, which scripts word as ERR
    "unknown redis command called from",  # a command renamed or disabled (rename-command)
    "not allowed from script",  # a command the server does not allow scripts (or this script)
    "write commands are not allowed from read-only scripts",
    "write commands not allowed after non deterministic commands",
)
CLASS_CODES: tuple[tuple[type[BaseException], str], ...] = (
    # redis-py before 7.4 strips the code of the errors it maps to a class and sets no status_code
    (redis.exceptions.ReadOnlyError, "READONLY"),
    (redis.exceptions.OutOfMemoryError, "OOM"),  # type: ignore[attr-defined]  # not in types-redis
    (redis.exceptions.BusyLoadingError, "LOADING"),
    (redis.exceptions.NoScriptError, "NOSCRIPT"),
    (redis.exceptions.ExecAbortError, "EXECABORT"),
    (redis.exceptions.NoPermissionError, "NOPERM"),
)
EMBEDDED_CODE = re.compile(r"(?:^|[:\-]\s*)([A-Z]{2,})(?=\s)")  # Redis 6: "...: @user_script:1: OOM ..."
PIPELINE_MARK = " of pipeline caused error: "
CLIENT_REPR_MARK = " : <redis."


class Scope(enum.Enum):
    """Who an error reply is about."""

    SERVER = "server"
    JOB = "job"
    UNKNOWN = "unknown"


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
    for kind, name in CLASS_CODES:  # redis-py before 7.4 (red team 33)
        if isinstance(error, kind):
            return name
    words = _text(error).lstrip("-").split(None, 1)
    word = words[0] if words else ""
    return word if word.isupper() and word.isalpha() else ""


def _acl_scope(text: str) -> Scope | None:
    """An ACL refusal's scope in any Redis version's wording (lowercased ``text``), or None."""
    if any(phrase in text for phrase in ACL_COMMAND_PHRASES):
        return Scope.SERVER
    if not any(phrase in text for phrase in ACL_PHRASES):
        return None
    return Scope.JOB if any(word in text for word in KEY_WORDS) else Scope.SERVER


def _embedded_code(text: str) -> str:
    """The first known code inside a generic error's text (Redis 6 wraps a script's error)."""
    for match in EMBEDDED_CODE.finditer(text):
        if match.group(1) in SERVER_CODES | JOB_CODES:
            return match.group(1)
    return ""


def scope(error: str | BaseException) -> Scope:
    """The one classification of a Redis error reply (see the module docstring)."""
    found = code(error)
    text = _text(error)
    if found in ("", "ERR", "NOPERM"):
        acl = _acl_scope(text.lower())
        if acl is not None:
            return acl
    if found in ("", "ERR"):
        if any(phrase in text.lower() for phrase in SERVER_PHRASES):
            return Scope.SERVER
        found = _embedded_code(text.split(None, 1)[1] if found and text.startswith(found) else text)
    if found in SERVER_CODES:
        return Scope.SERVER
    if found in JOB_CODES:
        return Scope.JOB
    return Scope.UNKNOWN


def reason(error: str | BaseException) -> str:
    """The reply as one bounded line, code first (Redis never echoes a password in an error)."""
    text = _text(error).strip()
    found = code(error)
    if found and not text.startswith(found):
        text = f"{found} {text}"
    return errors.first_line(Exception(text))[:MAX_REASON_CHARS]


def unavailable(label: str, error: str | BaseException) -> errors.BackendUnavailable:
    return errors.BackendUnavailable(f"{label} refused the write: {reason(error)}")


@contextlib.contextmanager
def translated(label: str) -> Iterator[None]:
    """The adapters' one exception boundary around a whole call to Redis.

    A lost, refused or timed-out connection (with redis-py's LOADING, authentication and
    Sentinel's "no master found", which it raises as connection errors) and an error reply of
    :attr:`Scope.SERVER` or :attr:`Scope.UNKNOWN` become BackendUnavailable, with no URL and no
    secret. An error reply of :attr:`Scope.JOB` for the whole call (an ACL refusing one job's key
    before a script or a transaction ran) propagates as it is: the relay then publishes the
    batch one job at a time, and only that job is rejected.
    """
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise errors.BackendUnavailable(f"{label}: {type(exc).__name__}: {reason(exc)}") from None
    except redis.ResponseError as exc:
        if scope(exc) is Scope.JOB:
            raise
        raise unavailable(label, exc) from None
