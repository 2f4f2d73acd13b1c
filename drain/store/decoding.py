"""One staged row as a job, under explicit limits: the decoding half of the reader's fault boundary.

``select_due`` (queries.sql) fetches nothing Python can fail to load (JSON as text, a timestamp
outside what ``datetime`` holds as null, its text beside it); :func:`decode` then turns one row
into a job, refusing with :class:`Unreadable` whatever it cannot hold: JSON nested deeper than
``drain.stage`` accepts, integers longer than Python's default digit limit (also where a process
lifted it), numbers a float cannot hold, the wrong JSON shapes, names longer than 1 KiB or not
UTF-8, a ``created_at`` outside ``datetime``'s range. drain.store.reading calls it for each row inside
its fault boundary, and makes any exception that row's refusal (:func:`refused`).
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import types
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, cast

from drain import errors, models
from drain.config.settings import MAX_SCHEDULE_NAME_CHARS
from drain.observability import tracing
from drain.staging import rows as staging_rows

UCS4_BYTES = 4  # the most a character takes in UTF-8 (and in a CPython string)
MAX_JSON_DEPTH = staging_rows.MAX_JSON_DEPTH
"""The deepest nesting a job's JSON may have: what ``drain.stage`` accepts."""
MAX_INT_DIGITS = 4300
"""The longest integer read from JSON (Python's default limit; a longer one costs quadratic time)."""
MAX_NAME_BYTES = 1024
"""job_name, queue and backend are names, not payloads: longer ones are refused."""
MAX_TICK_CHARS = 64
"""The longest ``drain_tick`` read (a schedule stages an ISO 8601 time with offset: 32)."""
SHOWN_NAME_CHARS = 200
"""A refused row's names are cut to this many characters (they go into logs and dead letters)."""
EARLIEST = datetime.datetime(1, 1, 3, tzinfo=datetime.UTC)
LATEST = datetime.datetime(9999, 12, 29, tzinfo=datetime.UTC)
"""Timestamps read as datetimes: Python's range less two days, as the session's time zone shows
them (a UTC offset can move a date across the edge)."""
UNREADABLE_AT = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
"""created_at of a refused row whose own created_at cannot be read (no adapter ever sees it)."""


BLANK = " \t\n\r\f\x0b"  # what the table's checks strip (btrim) before calling a name blank
_NO_KWARGS: Mapping[str, Any] = types.MappingProxyType({})
_EMPTY_ARRAY = ("[]", b"[]")  # a tuple, not a set: hashing a long text would read all of it
_EMPTY_OBJECT = ("{}", b"{}")


# The columns of select_due, in order.
(ID, JOB_ID, ATTEMPTS, ROW_BYTES, SENT, JOB_NAME, QUEUE, BACKEND, ARGS, KWARGS, OPTIONS) = range(11)
(CREATED_AT, CREATED_AT_TEXT, RUN_AT, AGE_S, ORDERING_KEY) = range(11, 16)


class Unreadable(Exception):
    """One row cannot be read; the message says why in one line, without the row's content."""


def decode(row: Sequence[Any], read_at: float, weight_bytes: int = 0) -> models.StagedJob:
    """One select_due row (sent with its content) as a job, under the limits of this module.

    Raises Unreadable (or whatever a decoder raised) when the row cannot be a job: JSON nested
    deeper than MAX_JSON_DEPTH, an integer longer than MAX_INT_DIGITS digits, a number too large
    for a float, job_args not an array or job_kwargs and options not objects, a name longer than
    MAX_NAME_BYTES or not UTF-8, a created_at outside EARLIEST..LATEST. The reserved trace keys
    leave its options here, before any adapter checks them (drain.observability.tracing), and so
    do a schedule's tick's (models.TICK_OPTIONS). A run_at
    outside that range is read as None: the row is due (it was selected), and nothing else needs its time.
    """
    created_at = row[CREATED_AT]
    if created_at is None:
        raise Unreadable(
            f"created_at {row[CREATED_AT_TEXT]} is outside the dates the drain reads "
            f"({EARLIEST.date()} to {LATEST.date()})"
        )
    args = _array(row[ARGS], "job_args")
    kwargs = _object(row[KWARGS], "job_kwargs")
    raw_options = _object(row[OPTIONS], "options")
    options, traceparent, tracestate = tracing.split(raw_options, row[ID], row[JOB_ID])
    options, schedule, tick = split_tick(options)
    return models.StagedJob(
        id=row[ID],
        job_id=row[JOB_ID],
        job_name=_name(row[JOB_NAME], "job_name"),
        args=args,
        kwargs=kwargs,
        queue=_name(row[QUEUE], "queue"),
        backend=_name(row[BACKEND], "backend"),
        options=options,
        created_at=created_at,
        attempts=row[ATTEMPTS],
        run_at=row[RUN_AT],
        age_s=row[AGE_S] or 0.0,
        read_at=read_at,
        traceparent=traceparent,
        tracestate=tracestate,
        schedule=schedule,
        tick=tick,
        ordering_key=_key(row[ORDERING_KEY]),
        memory_bytes=weight_bytes,
    )


def _key(value: str | bytes | None) -> str | None:
    """The ordering key, within the bounds the table's drain_key_check holds it to: at most
    MAX_KEY_BYTES characters (the table counts bytes in the database's encoding: in a LATIN1
    database a key of 255 bytes there is up to 510 in UTF-8, red team 32), not blank. A row staged
    while that constraint was off, with a longer key, is unreadable rather than a job with a key
    no backend carries; an adapter that needs fewer bytes (an AMQP routing key) checks its own."""
    if value is None:
        return None
    key = _name(value, "ordering_key")
    if len(key) > models.MAX_KEY_BYTES or not key.strip(BLANK):
        raise Unreadable(f"ordering_key is not 1 to {models.MAX_KEY_BYTES} characters, not blank")
    return key


def split_tick(options: Mapping[str, Any]) -> tuple[Mapping[str, Any], str | None, str | None]:
    """``options`` without the reserved tick keys (models.TICK_OPTIONS), the schedule's name and
    the tick. Either key present with values no schedule stages makes the row unreadable (never
    silently dropped: 0.1.0 refused such a row as an unknown option)."""
    if models.SCHEDULE_OPTION not in options and models.TICK_OPTION not in options:
        return options, None, None
    rest = {key: value for key, value in options.items() if key not in models.TICK_OPTIONS}
    found = _tick(options.get(models.SCHEDULE_OPTION), options.get(models.TICK_OPTION))
    if found is None:
        raise Unreadable(
            f"options {models.SCHEDULE_OPTION} and {models.TICK_OPTION} are reserved for the ticks of "
            f"[[schedules]]: both text, a schedule name of at most {MAX_SCHEDULE_NAME_CHARS} "
            f"characters and an ISO 8601 time of at most {MAX_TICK_CHARS}"
        )
    return rest, *found


def _tick(schedule: object, tick: object) -> tuple[str, str] | None:
    """(schedule, tick) when they are what a schedule stages, else None."""
    if not isinstance(schedule, str) or not isinstance(tick, str) or len(tick) > MAX_TICK_CHARS:
        return None
    if not schedule or len(schedule) > MAX_SCHEDULE_NAME_CHARS or not schedule.isprintable():
        return None
    try:
        datetime.datetime.fromisoformat(tick)
    except ValueError:
        return None
    return schedule, tick


def refused(row: Sequence[Any], read_at: float, why: str) -> models.StagedJob:
    """A job for a row the drain will not read: no content, names cut short, ``unreadable`` set."""
    return models.StagedJob(
        id=row[ID],
        job_id=row[JOB_ID] if isinstance(row[JOB_ID], uuid.UUID) else uuid.UUID(int=0),
        job_name=_shown(row[JOB_NAME]),
        args=(),
        kwargs=_NO_KWARGS,
        queue=_shown(row[QUEUE]),
        backend=_shown(row[BACKEND]),
        options=_NO_KWARGS,
        created_at=row[CREATED_AT] or UNREADABLE_AT,
        attempts=row[ATTEMPTS],
        age_s=row[AGE_S] or 0.0,
        read_at=read_at,
        unreadable=f"the drain cannot read this row: {why}",
    )


def reason(exc: BaseException) -> str:
    """One line saying why a row could not be decoded, never quoting its content."""
    if isinstance(exc, Unreadable):
        return str(exc)
    if isinstance(exc, RecursionError):
        return f"its JSON is nested deeper than {MAX_JSON_DEPTH} levels"
    return f"{type(exc).__name__}: {errors.first_line(exc)}"[:SHOWN_NAME_CHARS]


def _array(text: str | bytes | None, what: str) -> Sequence[Any]:
    if text in _EMPTY_ARRAY:
        return ()
    value = _parse(text, what)
    if not isinstance(value, list):
        raise Unreadable(f"{what} must be a JSON array, not {_json_type(value)}")
    return value


def _object(text: str | bytes | None, what: str) -> Mapping[str, Any]:
    if text in _EMPTY_OBJECT:
        return _NO_KWARGS
    value = _parse(text, what)
    if not isinstance(value, dict):
        raise Unreadable(f"{what} must be a JSON object, not {_json_type(value)}")
    return value


def _parse(text: str | bytes | None, what: str) -> Any:
    if text is None:
        raise Unreadable(f"{what} is null")
    if isinstance(text, bytes):  # a SQL_ASCII database: psycopg hands text over as bytes
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise Unreadable(f"{what} is not UTF-8") from None
    # json's own integer parser (in C) while Python's digit limit is at most ours.
    limit = sys.get_int_max_str_digits()
    scan = _SCAN if 0 < limit <= MAX_INT_DIGITS else _BOUNDED_SCAN
    try:
        value, end = scan(text, 0)  # jsonb's text has no whitespace around it
    except StopIteration as exc:
        raise Unreadable(f"{what} is not JSON: no value at character {exc.value}") from None
    except json.JSONDecodeError as exc:
        raise Unreadable(f"{what} is not JSON: {exc.msg} at character {exc.pos}") from None
    except RecursionError:
        raise Unreadable(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):
            raise Unreadable(f"{what} holds an integer of more than {limit} digits") from None
        raise
    if end != len(text):
        raise Unreadable(f"{what} is not JSON: extra data at character {end}")
    if _too_deep(value, text):
        raise Unreadable(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS + 1 or len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise Unreadable(f"a JSON integer has more than {MAX_INT_DIGITS} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Unreadable(f"a JSON number of {len(text)} characters is too large for a float")
    return value


# The decoders' scanners (C), called directly: JSONDecoder.decode adds two regex matches a call.
_SCAN = cast(Any, json.JSONDecoder(parse_float=_finite_float)).scan_once
_BOUNDED_SCAN = cast(Any, json.JSONDecoder(parse_int=_bounded_int, parse_float=_finite_float)).scan_once


def _too_deep(value: Any, text: str) -> bool:
    """Whether ``value`` nests deeper than MAX_JSON_DEPTH: only walked when the text opens more
    containers than that (fewer cannot nest that deep)."""
    if len(text) <= MAX_JSON_DEPTH:
        return False
    opened = text.count("[") + text.count("{")
    if opened <= MAX_JSON_DEPTH:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (list, dict)))
    return False


def _json_type(value: Any) -> str:
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return "a number"


def _name(value: str | bytes, what: str) -> str:
    if isinstance(value, str) and len(value) <= MAX_NAME_BYTES // UCS4_BYTES:
        return value  # the common name: short enough whatever its characters
    if isinstance(value, bytes):  # a SQL_ASCII database: psycopg hands text over as bytes
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise Unreadable(f"{what} is not UTF-8") from None
    if len(value.encode("utf-8")) > MAX_NAME_BYTES:
        raise Unreadable(f"{what} is longer than {MAX_NAME_BYTES} bytes")
    return value


def _shown(value: str | bytes | None) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return (value or "")[:SHOWN_NAME_CHARS]
