"""A batch as the drain reads it: within a memory budget, each row a job or that row's refusal.

Fault boundary
--------------
- ``select_due`` (queries.sql) fetches nothing Python can fail to load: JSON comes as text, and
  a timestamp ``datetime`` cannot hold comes as null with its text beside it.
- :func:`take` turns each row into a job on its own (:func:`decode`, under explicit limits).
- Any exception on the way is that row's refusal (:func:`refused`). The relay settles it like a
  backend's rejection: retried with backoff, then dead-lettered, while the rows around it flow.
- Nothing a row holds fails the batch, the step or the process.

Memory
------
- Each row is weighed before it is decoded (:func:`weight`, the BYTES_PER_ constants): an
  upper estimate of its job, decoded and as its backend's message.
- A batch takes rows in id order while their weights fit its budget (``batch_max_bytes`` less
  what the batches in flight hold); the rest wait for the next step.
- The server sends no more text than could fit (:class:`Reader`). It never sends a row whose
  text passes ``batch_max_bytes`` / ROW_SHARE: that row is refused unread, as is one that would
  weigh more than ``batch_max_bytes`` alone.
- The process's memory is then bounded by :func:`memory_bound_bytes`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import sys
import time
import types
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from drain import errors, models
from drain.config.settings import MAX_SCHEDULE_NAME_CHARS
from drain.observability import tracing
from drain.staging import rows as staging_rows

UCS4_BYTES = 4  # the most a character takes in UTF-8 (and in a CPython string)
MAX_JSON_DEPTH = staging_rows.MAX_JSON_DEPTH  # what ``drain.stage`` accepts
MAX_INT_DIGITS = 4300  # Python's default limit: a longer integer costs quadratic time
MAX_NAME_BYTES = 1024  # job_name, queue and backend are names, not payloads
MAX_TICK_CHARS = 64  # a schedule stages an ISO 8601 time with offset: 32
SHOWN_NAME_CHARS = 200  # a refused row's names, cut (they go into logs and dead letters)
EARLIEST = datetime.datetime(1, 1, 3, tzinfo=datetime.UTC)
LATEST = datetime.datetime(9999, 12, 29, tzinfo=datetime.UTC)
"""Timestamps read as datetimes: Python's range less two days, as the session's time zone shows
them (a UTC offset can move a date across the edge)."""
UNREADABLE_AT = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)  # a refused row's, when its own is not


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

    - Unreadable (or whatever a decoder raised): JSON too deep, an integer too long, a number too
      large for a float, the wrong JSON shapes, a name too long or not UTF-8, a created_at
      outside EARLIEST..LATEST.
    - The reserved trace and tick keys leave its options here, before any adapter checks them.
    - A run_at outside that range is None: the row is due (it was selected).
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
    # Positional, in the fields' order (a unit test compares it with the same job by keyword):
    # a frozen dataclass binds keywords at about half the cost of building the job.
    return models.StagedJob(
        row[ID],  # id
        row[JOB_ID],  # job_id
        _name(row[JOB_NAME], "job_name"),
        args,
        kwargs,
        _name(row[QUEUE], "queue"),
        _name(row[BACKEND], "backend"),
        options,
        created_at,
        row[ATTEMPTS],  # attempts
        row[RUN_AT],  # run_at
        row[AGE_S] or 0.0,  # age_s
        read_at,
        traceparent,
        tracestate,
        schedule,
        tick,
        _key(row[ORDERING_KEY]),  # ordering_key
        None,  # unreadable
        weight_bytes,  # memory_bytes
    )


def _key(value: str | bytes | None) -> str | None:
    """The ordering key, within drain_key_check's bounds: at most MAX_KEY_BYTES characters (the
    table counts bytes in its own encoding), not blank. A row staged while that constraint was
    off is unreadable rather than a job with a key no backend carries."""
    if value is None:
        return None
    key = _name(value, "ordering_key")
    if len(key) > models.MAX_KEY_BYTES or not key.strip(BLANK):
        raise Unreadable(f"ordering_key is not 1 to {models.MAX_KEY_BYTES} characters, not blank")
    return key


def split_tick(options: Mapping[str, Any]) -> tuple[Mapping[str, Any], str | None, str | None]:
    """``options`` without the reserved tick keys (models.TICK_OPTIONS), the schedule's name and
    the tick. Values no schedule stages make the row unreadable, never silently dropped."""
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
    text = _utf8(text, what)
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
    """Whether ``value`` nests deeper than MAX_JSON_DEPTH; walked only when the text opens more
    containers than that."""
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
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _name(value: str | bytes, what: str) -> str:
    if isinstance(value, str) and len(value) <= MAX_NAME_BYTES // UCS4_BYTES:
        return value  # the common name: short enough whatever its characters
    value = _utf8(value, what)
    if len(value.encode("utf-8")) > MAX_NAME_BYTES:
        raise Unreadable(f"{what} is longer than {MAX_NAME_BYTES} bytes")
    return value


def _utf8(value: str | bytes, what: str) -> str:
    if isinstance(value, str):
        return value
    try:  # a SQL_ASCII database: psycopg hands text over as bytes
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise Unreadable(f"{what} is not UTF-8") from None


def _shown(value: str | bytes | None) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return (value or "")[:SHOWN_NAME_CHARS]


BYTES_PER_CHAR = 4
"""What each byte of a row's text (UTF-8) weighs: the most a character takes once decoded (a
UCS-4 string), which also covers an ASCII text's message."""
BYTES_PER_MULTIBYTE = 8
"""What each byte of UTF-8 beyond a character's first weighs more: the message's escapes of a
non-ASCII character (``\\u00e9``: 6 bytes for 2; a surrogate pair, 12 for 4), and their copies
(Celery on Redis base64-encodes them again)."""
BYTES_PER_WIDE = 2
"""What each byte beyond one a character takes in a Python string weighs more, times the text's
length: one astral character makes a whole string 4 bytes a character."""
BYTES_PER_VALUE = 96
"""The most one JSON value or object member takes once decoded, beyond its characters (a
one-member dict: 184). Counted from the marks that open one (``,`` ``:`` ``[`` ``{``), also
inside a string: an overestimate."""
BYTES_PER_JOB = 2048
"""A job's own overhead: the StagedJob, its UUID, datetimes and names, its results."""
ROW_SHARE = 4
"""A row whose text passes batch_max_bytes / ROW_SHARE is never fetched (it would weigh more)."""
SHORT_TEXT_CHARS = 64
"""JSON text up to this long is weighed as if every character opened a value (no counting)."""
MIN_LIMIT_CAP = 8
"""After a select held rows back, the next asks for at least this many (see Reader)."""
WINDOW_PER_ROW = 2
MIN_WINDOW = 64
"""A select's branch looks at its first max(WINDOW_PER_ROW x rows asked, MIN_WINDOW) rows but for
their ordering key (queries.sql due_rows), except one select in FULL_EVERY, and at most one every
FULL_EVERY_S seconds, which looks at every row: rows behind a run of held rows longer than the
window wait that long at most, and a backlog of hot keys, or a key held behind a retry with a long
run of rows, costs a select its window, and one select a second its whole length."""
FULL_EVERY = 16
FULL_EVERY_S = 1.0
BASE_RSS_BYTES = 64 << 20
"""The drain's resident memory with nothing to read, rounded up (measured: README, Memory)."""
RSS_PER_BUDGET_BYTE = 3.0
"""What the process may hold beyond its base for each byte of batch_max_bytes (measured)."""

_JSON_MARKS = (",", ":", "[", "{")
_JSON_MARK_BYTES = tuple(mark.encode() for mark in _JSON_MARKS)
_WIDE_HEADER = sys.getsizeof("é") - 2
"""A compact non-ASCII string's size less its characters and terminator (one byte each here)."""


@dataclasses.dataclass(frozen=True)
class Taken:
    """What one select made of its rows: the jobs (refused ones included) in id order, and
    whether due rows were held back for want of budget (the next step should come at once)."""

    jobs: list[models.StagedJob]
    over_budget: bool
    text_bytes: int = 0
    """The text of the decoded rows (with ``weight``, how heavy this kind of row is)."""
    weight: int = 0
    decoded: int = 0


class Reader:
    """The reading side of one drain: its ``batch_max_bytes``, and what recent batches taught.

    - what a row weighed per byte of its text, so a select asks for no more text than can fit;
    - after a select that held rows back for want of budget, the next asks for at most twice
      the rows that fitted (at least MIN_LIMIT_CAP, doubling while they fit), so the server does
      not render a backlog of large rows a whole ``batch_size`` at a time to send a few.
    """

    def __init__(self, batch_max_bytes: int, dead_blocking: Sequence[str] = ()) -> None:
        self.batch_max_bytes = batch_max_bytes
        self.dead_blocking = list(dead_blocking)
        """The backends whose keyed rows wait while a dead letter of their key exists (key_free)."""
        self.bytes_per_text_byte = float(BYTES_PER_CHAR)
        self.limit_cap: int | None = None
        self._selects = 0
        self._everywhere_at = float("-inf")
        self.clock: Callable[[], float] = time.monotonic
        self.looked_everywhere = False
        """Whether the last select looked at every due row (no window): if it found nothing, none is free."""
        self._asked = self._wanted = 0
        self.other_lanes: str | None = None
        """The lanes this drain does *not* lead, as an array's text (drain.relay.lanes; queries.sql
        ``in_lanes`` says why not those it leads); None: every row."""
        self.lane_count = 1
        self.led_lanes: str | None = None
        """The lanes this drain leads, as an array's text (queries.sql due_now_lanes)."""
        self.led_count = 0
        self.lanes_indexed = False
        """Whether the lanes index and function for ``lane_count`` serve (Store.lanes_index_problem)."""
        self.lanes_failed = False
        """A select through the lanes index failed (Store.lanes_index_problem: not that function again)."""

    def indexed_lanes(self) -> int | None:
        """The lane count select_due is rendered for when it has a window, to read this drain's
        lanes through their index (queries.sql due_now_lanes); None: it walks the due index.

        Through the index when it is there and this drain leads k of N lanes with k x k <= 2 N
        (4 of 8, 5 of 16, 22 of 256): lane by lane a select reads each lane's first window + 1
        rows (k x the window); the walk of the due index reads every lane's rows up to its window
        (N / k x the window), and past the rows the other members deleted that no vacuum has
        cleared yet, which the lanes index holds only of this drain's lanes. In a table at rest
        the index reads less while k < N / k (128 of 256 lanes: 139 ms a select against 17
        walking); with drains deleting, 4 of 8 through the index forwarded 1.4 times what they
        did walking (docs/benchmarks.md)."""
        led = self.led_count
        if self.lanes_indexed and self.lane_count > 1 and 0 < led * led <= 2 * self.lane_count:
            return self.lane_count
        return None

    def params(self, limit: int, budget_bytes: int) -> dict[str, Any]:
        """select_due's limit and size parameters for a select of up to ``limit`` rows that may
        take ``budget_bytes`` of weight."""
        self._wanted = limit
        self._asked = limit if self.limit_cap is None else max(min(limit, self.limit_cap), 1)
        return {
            "limit": self._asked,
            "max_row_bytes": self.batch_max_bytes // ROW_SHARE,
            "chunk_bytes": max(int(budget_bytes / self.bytes_per_text_byte), 0),
            "first_bytes": max(budget_bytes // BYTES_PER_CHAR, 0),
            "name_chars": SHOWN_NAME_CHARS,
            "key_chars": models.MAX_KEY_BYTES + 1,  # a longer key is refused: no need to read it
            "dead_blocking": self.dead_blocking,
            "earliest": EARLIEST,
            "latest": LATEST,
            "window": self._window_for(self._asked),
            "other_lanes": self.other_lanes,
            "lane_count": self.lane_count,
            "lanes": self.led_lanes,
        }

    def idle_params(self) -> dict[str, Any]:
        """The parameters of the idle leader's "anything due?" (queries.sql anything_due): the
        last select's window, never none."""
        return {
            "dead_blocking": self.dead_blocking,
            "window": max(WINDOW_PER_ROW * self._asked, MIN_WINDOW),
            "other_lanes": self.other_lanes,
            "lane_count": self.lane_count,
        }

    def _window_for(self, limit: int) -> int | None:
        """How many rows past the first a select's branch looks at (queries.sql due_rows): see
        FULL_EVERY."""
        self._selects += 1
        now = self.clock()
        self.looked_everywhere = self._selects >= FULL_EVERY and now - self._everywhere_at >= FULL_EVERY_S
        if not self.looked_everywhere:
            return max(WINDOW_PER_ROW * limit, MIN_WINDOW)
        self._selects, self._everywhere_at = 0, now
        return None

    def take(self, rows: Sequence[Sequence[Any]], budget_bytes: int, read_at: float) -> Taken:
        """:func:`take` for the select just made with :meth:`params`, learning from it. Rows
        count as held back also when a capped select came back full (more may be due)."""
        taken = take(rows, batch_max_bytes=self.batch_max_bytes, budget_bytes=budget_bytes, read_at=read_at)
        if taken.text_bytes:
            per_byte = (taken.weight - BYTES_PER_JOB * taken.decoded) / taken.text_bytes
            self.bytes_per_text_byte = max(float(BYTES_PER_CHAR), per_byte)
        capped_and_full = self._asked < self._wanted and len(rows) >= self._asked
        if taken.over_budget:
            self.limit_cap = max(2 * len(taken.jobs), MIN_LIMIT_CAP)
        elif capped_and_full:
            self.limit_cap = 2 * self._asked
        else:
            self.limit_cap = None
        if capped_and_full and not taken.over_budget:
            return dataclasses.replace(taken, over_budget=True)
        return taken


def memory_bound_bytes(batch_max_bytes: int, *, base_bytes: int = BASE_RSS_BYTES) -> int:
    """The most resident memory a drain should reach with this ``batch_max_bytes``: its base
    plus RSS_PER_BUDGET_BYTE for each byte of the budget (the README's formula)."""
    return int(base_bytes + RSS_PER_BUDGET_BYTE * batch_max_bytes)


def take(rows: Sequence[Sequence[Any]], *, batch_max_bytes: int, budget_bytes: int, read_at: float) -> Taken:
    """The jobs of select_due's ``rows``, in id order, within ``budget_bytes`` of weight.

    A row refused (too large to fetch, too heavy, or failing :func:`decode`) is a job with
    ``unreadable`` set and no content. A row that does not fit what is left of the budget, and
    every sent row after it, is held back (no job). Never raises for a row's content.
    """
    jobs: list[models.StagedJob] = []
    over_budget = False
    spent = text_bytes = decoded = 0
    max_row_bytes = batch_max_bytes // ROW_SHARE
    for row in rows:
        if not row[SENT]:
            if row[ROW_BYTES] > max_row_bytes:
                jobs.append(refused(row, read_at, too_large(row[ROW_BYTES], batch_max_bytes)))
            else:
                over_budget = True
            continue
        if over_budget:
            continue
        try:
            heavy = weight(row)
            if heavy > batch_max_bytes:
                raise Unreadable(too_heavy(heavy, batch_max_bytes))
            if spent + heavy > budget_bytes:
                over_budget = True
                continue
            job = decode(row, read_at, heavy)
        except Exception as exc:  # noqa: BLE001 - the fault boundary: this row's refusal, never the batch's
            jobs.append(refused(row, read_at, reason(exc)))
            continue
        spent += heavy
        text_bytes += row[ROW_BYTES]
        decoded += 1
        jobs.append(job)
    return Taken(jobs, over_budget, text_bytes, spent, decoded)


def weight(row: Sequence[Any]) -> int:
    """An upper estimate, in bytes, of what ``row``'s job takes in the drain once decoded and
    built into its backend's message (see the module docstring). O(1) for text that is ASCII."""
    text_bytes = int(row[ROW_BYTES])
    args, kwargs, options = row[ARGS], row[KWARGS], row[OPTIONS]
    values = _marks(args) + _marks(kwargs) + _marks(options)
    heavy = BYTES_PER_JOB + BYTES_PER_CHAR * text_bytes + BYTES_PER_VALUE * values
    chars = wide = 0
    for text in (row[JOB_NAME], row[QUEUE], row[BACKEND], args, kwargs, options):
        if text is None:
            continue
        if text.isascii():  # a str knows (O(1)); bytes (a SQL_ASCII database) are scanned
            chars += len(text)
        elif isinstance(text, str):
            chars += len(text)
            per_char = (sys.getsizeof(text) - _WIDE_HEADER) // (len(text) + 1)
            wide += (per_char - 1) * len(text)
        else:  # UTF-8 of unknown characters: as many 4-byte ones, and as wide, as could be
            chars += len(text) // 4
            wide += 3 * len(text)
    return heavy + BYTES_PER_MULTIBYTE * max(text_bytes - chars, 0) + BYTES_PER_WIDE * wide


def _marks(text: str | bytes | None) -> int:
    if text is None:
        return 0
    if len(text) <= SHORT_TEXT_CHARS:
        return len(text)
    if isinstance(text, bytes):
        return sum(text.count(mark) for mark in _JSON_MARK_BYTES)
    return text.count(",") + text.count(":") + text.count("[") + text.count("{")


def too_large(row_bytes: int, batch_max_bytes: int) -> str:
    return (
        f"it is {row_bytes} bytes as text, over batch_max_bytes / {ROW_SHARE} = "
        f"{batch_max_bytes // ROW_SHARE}; it was not fetched"
    )


def too_heavy(weight_bytes: int, batch_max_bytes: int) -> str:
    return (
        f"decoded it would take about {weight_bytes} bytes, over batch_max_bytes = {batch_max_bytes}; "
        "it was not decoded"
    )
