"""The values a settlement's writes take and return, and the words they leave in a row.

The relay (drain.relay.settle.decide) decides each row's settlement: delete it, push it back
(:class:`Retry`), or bury it (:class:`Dead`). drain.store.session.Batch writes each part.
"""

from __future__ import annotations

import dataclasses
import datetime
import uuid
from typing import Any, NamedTuple, cast

from drain import models

PARKED_AT = datetime.datetime(9000, 1, 1, tzinfo=datetime.UTC)
"""The run_at of a parked row (Batch.park): never due; below the table's check's bound (9999)."""
PARKED_PREFIX = "drain: parked:"
"""How a parked row's last_error starts: with PARKED_AT, what tells it from a job an app staged
for that date (``parked_count``)."""
PARKED_IN_PLACE_PREFIX = "drain: parked in place:"
"""How the last_error of a row parked in place starts (Batch.park_in_place: the table refused
its parking too, so its run_at stays): no statement that looks for due rows takes such a row
(``not_parked_in_place`` in queries.sql, which spells it out)."""
DELETE, RETRY, BURY, SELECT = "delete", "retry", "bury", "select"
PROBE_KINDS = (DELETE, RETRY, BURY)
"""The kinds of settlement write a probe tries (Batch.test_table, Batch.probe); SELECT is the
read of a row of the drain's own."""
PROBE_ERROR = "drain: probe (rolled back)"
PROBE_JOB_NAME = "drain.probe"
"""The job_name of the row of its own a probe writes and rolls back (Batch.test_table)."""
PROBE_LOCK_WAIT_MS = 1000
"""The longest a probe's statement waits for a lock: longer, the table is locked against writes."""
OWN_ROW, ANY_ROW = "a row of its own", "any row"
"""What a probe wrote (ProbeFailure.target), besides the due rows."""

Key = tuple[int, uuid.UUID]
"""A row as a settlement names it: id and job_id."""


class Refusal(NamedTuple):
    """Why the table refused one row's settlement; ``transient`` (a lock wait, a serialization
    failure, a cancelled statement: :func:`transient`) when writing it again may go through."""

    why: str
    transient: bool = False


Refused = dict[int, Refusal]
"""Rows whose settlement the table refused, by id, with why."""
Done = tuple[int, set[int] | None]
"""What a settlement statement changed: how many rows, and which (None: not known)."""


class ProbeFailure(NamedTuple):
    """The kind of write (DELETE, RETRY, BURY, or the SELECT of a row of its own) a probe's
    ``target`` did not take, and why."""

    kind: str
    detail: str
    target: str = "due rows"


TRIED = {
    SELECT: "a test read",
    DELETE: "a test DELETE",
    RETRY: "a test retry UPDATE (attempts, backoff)",
    BURY: "a test burial in the dead-letter table",
}
"""What a probe tried, by kind of write (drain.relay.leadership names its reasons after them)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Retry:
    """A failed row to push back: ``counted`` (0 or 1) is added to its attempts."""

    row_id: int
    job_id: uuid.UUID
    counted: int
    error: str
    delay_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class Dead:
    """A row to move to the dead-letter table with its error."""

    job: models.StagedJob
    error: str
    attempts: int


def storable(text: str) -> str:
    """An error as a text column holds it: a NUL or a lone surrogate (an adapter's message may
    carry either) would make PostgreSQL refuse the whole settlement, so they are escaped."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def refused_by_table(rows: int, kind: str, detail: str, target: str) -> str:
    """A part of a settlement refused for all its ``rows``, and the same ``kind`` of write of the
    probe's ``target`` refused too: the table refuses it, not those rows."""
    what = TRIED[kind].removeprefix("a test ")
    return f"the table refused the {what} of {rows} rows, and of {target} (rolled back): {detail}"


def transient(exc: BaseException) -> bool:
    """Whether a row's refused write may go through when written again: a serialization failure
    or a deadlock (class 40), a lock wait (55P03), a cancelled statement (57014). Such a row is
    held and tried again, never parked (drain.relay.settle); whether the *table* refuses is never
    decided by the error (Batch.test_table)."""
    sqlstate = getattr(exc, "sqlstate", None) or ""
    return sqlstate.startswith("40") or sqlstate in ("55P03", "57014")


def skipped(changed: int, asked: int) -> str:
    """Why a statement that changed fewer rows than asked, without an error, refused the others."""
    return (
        f"the statement changed {changed} of {asked} rows and left the others in place without an "
        "error (a trigger returning NULL, a rule, or a row-level security policy?)"
    )


def key(item: Any) -> Key:
    """The row a settlement item names: a Key as it is, a Retry's or a Dead's row."""
    if isinstance(item, Retry):
        return item.row_id, item.job_id
    if isinstance(item, Dead):
        return item.job.id, item.job.job_id
    return cast(Key, item)


class Skipped(Exception):
    """A settlement statement left rows in place without an error (raised to roll it back)."""
