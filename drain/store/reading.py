"""A batch as the drain reads it: within a memory budget, each row a job or that row's refusal.

The fault boundary of reading. ``select_due`` (queries.sql) fetches nothing Python can fail to
load; :func:`take` then turns each row into a job on its own with drain.store.decoding, and *any*
exception on the way becomes that row's refusal (``StagedJob.unreadable``), which the gate
rejects before any backend sees it and the relay settles like a backend's rejection: retried
with backoff, then dead-lettered with the reason, while the rows around it flow. Nothing a row
holds fails the batch, the step or the process.

Memory: each row is weighed before it is decoded (:func:`weight`), an upper estimate of what its
job takes in the drain, decoded and as its backend's message: 4 bytes for each byte of its text
(UTF-8), 96 bytes for each JSON value or member (a one-member dict is 184 bytes), counted from
the marks that open one (``,`` ``:`` ``[`` ``{``, also when inside a string: an overestimate),
plus a job's own overhead; and for text that is not ASCII, 8 bytes more for each byte of UTF-8
beyond a character's first (every backend's JSON escapes such a character to 6 or 12 bytes,
``\\u00e9``, and Celery on Redis base64-encodes that again) and 2 bytes more for each byte a
character takes beyond one in the text's Python string (one astral character makes a whole
string 4 bytes a character, in the text and in what it decodes to). A batch takes rows in id
order while their weights fit the budget it is given (``batch_max_bytes`` less what the batches
in flight hold); the rest are held back for the next step. The server sends no more text than
could fit (at most a quarter of the budget, as 4 bytes a byte of text is the least a row weighs;
less when recent rows weighed more per byte: :class:`Reader`), and never a row whose text passes
a quarter of ``batch_max_bytes``: such a row is refused unread, as is a row that would weigh more
than ``batch_max_bytes`` on its own. The process's memory is then bounded by :func:`memory_bound_bytes`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from drain import models
from drain.store import decoding

BYTES_PER_CHAR = 4
"""What each byte of a row's text (UTF-8) weighs: the most a character takes once decoded (a
UCS-4 string), which also covers an ASCII text's message."""
BYTES_PER_MULTIBYTE = 8
"""What each byte of UTF-8 beyond a character's first weighs more: the message's escapes of a
non-ASCII character (``\\u00e9``: 6 bytes for 2; a surrogate pair, 12 for 4) and their copies."""
BYTES_PER_WIDE = 2
"""What each byte beyond one a character takes in a Python string weighs more (times the text's
length: the decoded strings and the text are as wide)."""
BYTES_PER_VALUE = 96
"""The most one JSON value or object member takes once decoded, beyond its characters."""
BYTES_PER_JOB = 2048
"""A job's own overhead: the StagedJob, its UUID, datetimes and names, its results."""
ROW_SHARE = 4
"""A row whose text passes batch_max_bytes / ROW_SHARE is never fetched (it would weigh more)."""
SHORT_TEXT_CHARS = 64
"""JSON text up to this long is weighed as if every character opened a value (no counting)."""
MIN_LIMIT_CAP = 8
WINDOW_PER_ROW = 2
MIN_WINDOW = 64
"""A select's branch looks at its first max(WINDOW_PER_ROW x rows asked, MIN_WINDOW) rows but for
their ordering key (queries.sql due_rows), except one select in FULL_EVERY, and at most one every
FULL_EVERY_S seconds, which looks at every row: rows behind a run of held rows longer than the
window wait that long at most, and a backlog of hot keys, or a key held behind a retry with a long
run of rows, costs a select its window, and one select a second its whole length (red team 32)."""
FULL_EVERY = 16
FULL_EVERY_S = 1.0
"""After a select held rows back, the next asks for at least this many (see Reader)."""
BASE_RSS_BYTES = 64 << 20
"""The drain's resident memory with nothing to read, rounded up (measured: README, Memory)."""
RSS_PER_BUDGET_BYTE = 3.0
"""What the process may hold beyond its base for each byte of batch_max_bytes (measured)."""

_JSON_MARKS = (",", ":", "[", "{")
_JSON_MARK_BYTES = tuple(mark.encode() for mark in _JSON_MARKS)
_TEXT_FIELDS = (
    decoding.JOB_NAME,
    decoding.QUEUE,
    decoding.BACKEND,
    decoding.ARGS,
    decoding.KWARGS,
    decoding.OPTIONS,
)
_WIDE_HEADER = sys.getsizeof("é") - 2
"""A compact non-ASCII string's size less its characters and terminator (one byte each here)."""


@dataclasses.dataclass(frozen=True)
class Taken:
    """What one select made of its rows: the jobs (refused ones included) in id order, and
    whether due rows were held back for want of budget (the next step should come at once)."""

    jobs: list[models.StagedJob]
    held_back: bool
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
            "name_chars": decoding.SHOWN_NAME_CHARS,
            "key_chars": models.MAX_KEY_BYTES + 1,  # a longer key is refused: no need to read it
            "dead_blocking": self.dead_blocking,
            "earliest": decoding.EARLIEST,
            "latest": decoding.LATEST,
            "window": self._window_for(self._asked),
        }

    def idle_params(self) -> dict[str, Any]:
        """The parameters of the idle leader's "anything due?" (queries.sql anything_due): the
        last select's window, never none."""
        return {"dead_blocking": self.dead_blocking, "window": max(WINDOW_PER_ROW * self._asked, MIN_WINDOW)}

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
        if taken.held_back:
            self.limit_cap = max(2 * len(taken.jobs), MIN_LIMIT_CAP)
        elif capped_and_full:
            self.limit_cap = 2 * self._asked
        else:
            self.limit_cap = None
        if capped_and_full and not taken.held_back:
            return dataclasses.replace(taken, held_back=True)
        return taken


def memory_bound_bytes(batch_max_bytes: int, *, base_bytes: int = BASE_RSS_BYTES) -> int:
    """The most resident memory a drain should reach with this ``batch_max_bytes``: its base
    plus RSS_PER_BUDGET_BYTE for each byte of the budget (the README's formula)."""
    return int(base_bytes + RSS_PER_BUDGET_BYTE * batch_max_bytes)


def take(rows: Sequence[Sequence[Any]], *, batch_max_bytes: int, budget_bytes: int, read_at: float) -> Taken:
    """The jobs of select_due's ``rows``, in id order, within ``budget_bytes`` of weight.

    A row refused (too large to fetch, too heavy, or failing ``decoding.decode``) is a job with
    ``unreadable`` set and no content. A row that does not fit what is left of the budget, and
    every sent row after it, is held back (no job). Never raises for a row's content.
    """
    jobs: list[models.StagedJob] = []
    held_back = False
    spent = text_bytes = decoded = 0
    max_row_bytes = batch_max_bytes // ROW_SHARE
    for row in rows:
        if not row[decoding.SENT]:
            if row[decoding.ROW_BYTES] > max_row_bytes:
                jobs.append(
                    decoding.refused(row, read_at, too_large(row[decoding.ROW_BYTES], batch_max_bytes))
                )
            else:
                held_back = True
            continue
        if held_back:
            continue
        try:
            heavy = weight(row)
            if heavy > batch_max_bytes:
                raise decoding.Unreadable(too_heavy(heavy, batch_max_bytes))
            if spent + heavy > budget_bytes:
                held_back = True
                continue
            job = decoding.decode(row, read_at, heavy)
        except Exception as exc:  # noqa: BLE001 - the fault boundary: this row's refusal, never the batch's
            jobs.append(decoding.refused(row, read_at, decoding.reason(exc)))
            continue
        spent += heavy
        text_bytes += row[decoding.ROW_BYTES]
        decoded += 1
        jobs.append(job)
    return Taken(jobs, held_back, text_bytes, spent, decoded)


def weight(row: Sequence[Any]) -> int:
    """An upper estimate, in bytes, of what ``row``'s job takes in the drain once decoded and
    built into its backend's message (see the module docstring). O(1) for text that is ASCII."""
    text_bytes = int(row[decoding.ROW_BYTES])
    values = _marks(row[decoding.ARGS]) + _marks(row[decoding.KWARGS]) + _marks(row[decoding.OPTIONS])
    heavy = BYTES_PER_JOB + BYTES_PER_CHAR * text_bytes + BYTES_PER_VALUE * values
    chars = wide = 0
    for text in (row[index] for index in _TEXT_FIELDS):
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
    length = len(text)
    if length <= SHORT_TEXT_CHARS:
        return length
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
