"""Turn a job into the parameters of one staged row, refusing anything Postgres would refuse.

Every check runs before a statement is sent: a value Postgres rejects mid-statement aborts the
caller's whole transaction, while a StagingError raised here leaves it usable. What Postgres
refuses and Python happily produces: a NUL character in text or in a JSON string (``\\u0000``),
lone surrogates (not UTF-8), NaN and infinities, integers too long to print, nesting deep enough
to exhaust a parser's stack, an interval past the timestamp range.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from drain import errors
from drain.observability import tracing

MAX_PAYLOAD_BYTES = 1 << 20
MAX_JSON_DEPTH = 64
MAX_SHOWN_CHARS = 80
MAX_DELAY_S = 100 * 366 * 24 * 3600.0  # a century: far beyond any job, far inside Postgres' range
# The table's constraints (drain/store/sql/schema.sql, drain_*), which the SQL function checks too.
MAX_NAME_BYTES = 1024  # job_name, queue, backend
MAX_KEY_BYTES = 255  # ordering_key: the longest AMQP routing key, so a key can be one
ASCII_BLANKS = " \t\n\r\f\x0b"  # what the table's checks trim (btrim) to find a blank value
EARLIEST_RUN_AT = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
LATEST_RUN_AT = datetime.datetime(9999, 1, 1, tzinfo=datetime.UTC)  # excluded
_JSON_SCALARS = (str, int, float, bool, type(None))

JobName = str | Callable[..., Any]
EMPTY_OBJECT = "{}"
# One encoder, built once: json.dumps with any non-default option builds a new one per call.
_ENCODER = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(",", ":"))


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """A job to stage with :func:`drain.stage_many`; the fields mean what :func:`drain.stage`'s
    arguments do (``job_name`` is a dotted name or a module-level function)."""

    job_name: JobName
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] | None = None
    queue: str = "default"
    backend: str = "default"
    run_at: datetime.datetime | None = None
    delay: datetime.timedelta | float | None = None
    job_id: uuid.UUID | str | None = None
    options: Mapping[str, Any] | None = None
    ordering_key: str | None = None


def job_from(item: Job | Mapping[str, Any]) -> Job:
    """A Job from a Job or a mapping of its fields (an unknown key is a StagingError)."""
    if isinstance(item, Job):
        return item
    if not isinstance(item, Mapping):
        raise errors.StagingError(f"a job must be a drain.Job or a mapping, not {type(item).__name__}")
    try:
        return Job(**item)
    except TypeError as exc:
        raise errors.StagingError(str(exc)) from None


def row(job: Job) -> tuple[dict[str, Any], uuid.UUID]:
    """The statement parameters for ``job`` (JSON columns as text, job_id as a string, which
    every driver sends as it is) and its job id. ``ordering_key`` is a parameter only when the
    job has one: the statements of unkeyed jobs name no such column (see :func:`keyed`)."""
    if not isinstance(job.args, (list, tuple)):
        raise errors.StagingError(f"args must be a list or tuple, not {type(job.args).__name__}")
    kwargs = {} if job.kwargs is None else _object(job.kwargs, "kwargs")
    options = tracing.with_current_context({} if job.options is None else _object(job.options, "options"))
    if job.run_at is not None and job.delay is not None:
        raise errors.StagingError("give run_at or delay, not both")
    job_id = _job_id(job.job_id)
    params = {
        "job_name": job_name(job.job_name),
        "job_args": _dump(job.args, "args"),
        "job_kwargs": _dump(kwargs, "kwargs") if kwargs else EMPTY_OBJECT,
        "queue": text(job.queue, "queue"),
        "backend": text(job.backend, "backend"),
        "job_id": str(job_id),
        "run_at": _run_at(job.run_at),
        "delay_s": _delay_seconds(job.delay),
        "options": _dump(options, "options") if options else EMPTY_OBJECT,
    }
    if job.ordering_key is not None:
        params["ordering_key"] = ordering_key(job.ordering_key)
    return params, job_id


def keyed(params: Mapping[str, Any]) -> bool:
    """Whether a row from :func:`row` has an ordering key. Its statement then names the column;
    an unkeyed row's never does, so a producer role granted INSERT on the columns of an older
    release (no ``ordering_key``) stages unkeyed jobs as before."""
    return "ordering_key" in params


def row_json(params: Mapping[str, Any]) -> str:
    """One row as a JSON object (for the one-statement insert of many), built from the pieces
    already serialised by :func:`row` instead of parsing and dumping them again."""
    run_at = params["run_at"]
    delay_s = params["delay_s"]
    return (
        f'{{"job_name":{_ENCODER.encode(params["job_name"])},'
        f'"job_args":{params["job_args"]},"job_kwargs":{params["job_kwargs"]},'
        f'"queue":{_ENCODER.encode(params["queue"])},'
        f'"backend":{_ENCODER.encode(params["backend"])},'
        f'"job_id":"{params["job_id"]}",'
        f'"run_at":{_ENCODER.encode(run_at.isoformat()) if run_at is not None else "null"},'
        f'"delay_s":{repr(delay_s) if delay_s is not None else "null"},"options":{params["options"]}'
        f"{_key_json(params)}}}"
    )


def _key_json(params: Mapping[str, Any]) -> str:
    # Absent for an unkeyed row: jsonb_to_recordset reads a missing key as NULL.
    if "ordering_key" not in params:
        return ""
    return f',"ordering_key":{_ENCODER.encode(params["ordering_key"])}'


def job_name(value: Any) -> str:
    """A dotted name as given, or a function resolved to ``module.qualname`` (what RQ and Celery
    import). Lambdas, nested functions, bound methods and ``__main__`` have no such path."""
    if isinstance(value, str):
        return text(value, "job_name")
    if not callable(value):
        raise errors.StagingError(f"job_name must be a non-empty string or a function, not {show(value)}")
    if inspect.ismethod(value):
        raise errors.StagingError(
            f"job_name: {value.__qualname__} is a bound method; a worker imports a module-level "
            "function by its dotted path, so pass that function (or its dotted name)"
        )
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise errors.StagingError(
            f"job_name: a {type(value).__name__} has no importable dotted path; pass a "
            "module-level function or a dotted name"
        )
    if qualname == "<lambda>" or "<lambda>" in qualname:
        raise errors.StagingError("job_name: a lambda has no importable dotted path; use a module-level def")
    if "<locals>" in qualname:
        raise errors.StagingError(
            f"job_name: {qualname} is defined inside a function; a worker cannot import it"
        )
    if module == "__main__":
        raise errors.StagingError(
            f"job_name: {qualname} is defined in __main__, which a worker cannot import; "
            "move it to a module or pass its dotted name"
        )
    return text(f"{module}.{qualname}", "job_name")


def show(value: Any) -> str:
    """A short repr for an error message: never the whole payload, never an exception of its own
    (repr of an int past 4,300 digits raises)."""
    try:
        shown = repr(value)
    except ValueError:
        return f"<{type(value).__name__} too long to show>"
    return shown if len(shown) <= MAX_SHOWN_CHARS else f"{shown[:MAX_SHOWN_CHARS]}..."


def text(value: Any, what: str) -> str:
    """A non-blank string of at most MAX_NAME_BYTES that Postgres can store in a text column."""
    if not isinstance(value, str) or not value.strip():
        raise errors.StagingError(f"{what} must be a non-empty string, not {show(value)}")
    if "\x00" in value:
        raise errors.StagingError(f"{what} must not contain a NUL character")
    size = len(_utf8(value, what))
    if size > MAX_NAME_BYTES:
        raise errors.StagingError(f"{what} is {size} bytes; the limit is {MAX_NAME_BYTES}")
    return value


def ordering_key(value: Any) -> str | None:
    """None (no key) or a string of 1 to MAX_KEY_BYTES bytes of UTF-8 that Postgres can store,
    not blank: exactly what the table's check (``drain_key_check_v1``) accepts, whose blanks are
    ASCII whitespace only (``str.strip()`` would refuse keys it accepts, such as a no-break
    space). The key is kept as given, never trimmed: it is compared byte for byte."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise errors.StagingError(f"ordering_key must be None or a string, not {type(value).__name__}")
    if not value.strip(ASCII_BLANKS):
        raise errors.StagingError("ordering_key must not be empty or blank (None means no key)")
    if "\x00" in value:
        raise errors.StagingError("ordering_key must not contain a NUL character")
    size = len(_utf8(value, "ordering_key"))
    if size > MAX_KEY_BYTES:
        raise errors.StagingError(f"ordering_key is {size} bytes; the limit is {MAX_KEY_BYTES}")
    return value


def _utf8(value: str, what: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise errors.StagingError(f"{what} is not valid Unicode (a lone surrogate)") from None


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise errors.StagingError(f"{what} must be a mapping with string keys, not {type(value).__name__}")
    if not all(isinstance(key, str) for key in value):
        raise errors.StagingError(f"{what} must be a mapping with string keys")
    return dict(value)


def _dump(value: Any, what: str) -> str:
    """``value`` as JSON text that a jsonb column accepts, or StagingError naming the problem."""
    _check_json(value, what, 0)
    try:
        dumped = _ENCODER.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise errors.StagingError(f"{what} must be JSON-serialisable: {exc}") from None
    size = len(_utf8(dumped, what))
    if size > MAX_PAYLOAD_BYTES:
        raise errors.StagingError(f"{what} is {size} bytes of JSON; the limit is {MAX_PAYLOAD_BYTES}")
    return dumped


def _check_json(value: Any, what: str, depth: int) -> None:
    """Refuse what json.dumps would mangle or Postgres refuse: non-string keys (json.dumps turns
    ``1`` into ``"1"`` silently), NUL, NaN, unknown types, nesting past MAX_JSON_DEPTH."""
    if isinstance(value, str):
        if "\x00" in value:
            raise errors.StagingError(f"{what} must be JSON-serialisable: a string holds a NUL character")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise errors.StagingError(f"{what} must be JSON-serialisable: {value} is not a JSON number")
        return
    if isinstance(value, _JSON_SCALARS):
        return
    if depth >= MAX_JSON_DEPTH:
        raise errors.StagingError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_json(item, what, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise errors.StagingError(
                    f"{what} must be JSON-serialisable: a mapping has the non-string key {show(key)}"
                )
            if "\x00" in key:
                raise errors.StagingError(f"{what} must be JSON-serialisable: a key holds a NUL character")
            _check_json(item, what, depth + 1)
        return
    raise errors.StagingError(f"{what} must be JSON-serialisable: {type(value).__name__} is not a JSON type")


def _job_id(value: uuid.UUID | str | None) -> uuid.UUID:
    if value is None:
        return uuid.uuid4()
    if isinstance(value, uuid.UUID):
        return value
    if not isinstance(value, str):
        raise errors.StagingError(f"job_id must be a UUID, not {type(value).__name__}")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise errors.StagingError(f"job_id must be a UUID, not {show(value)}") from None


def _run_at(value: Any) -> datetime.datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime.datetime):
        raise errors.StagingError(f"run_at must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise errors.StagingError("run_at must be timezone-aware (a naive datetime is ambiguous)")
    try:
        in_range = EARLIEST_RUN_AT <= value < LATEST_RUN_AT
    except OverflowError:  # an offset that carries it past datetime's own range
        in_range = False
    if not in_range:
        raise errors.StagingError(
            f"run_at must be from {EARLIEST_RUN_AT:%Y-%m-%d} to before {LATEST_RUN_AT:%Y-%m-%d} (UTC), "
            f"not {show(value)}"
        )
    return value


def _delay_seconds(delay: Any) -> float | None:
    if delay is None:
        return None
    seconds = delay.total_seconds() if isinstance(delay, datetime.timedelta) else delay
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise errors.StagingError(f"delay must be seconds or a timedelta, not {show(delay)}")
    try:
        seconds = float(seconds)
    except OverflowError:
        raise errors.StagingError(f"delay must be at most {MAX_DELAY_S:.0f} seconds") from None
    if not math.isfinite(seconds):
        raise errors.StagingError(f"delay must be seconds or a timedelta, not {show(delay)}")
    if seconds < 0:
        raise errors.StagingError(f"delay must not be negative, not {seconds}")
    if seconds > MAX_DELAY_S:
        raise errors.StagingError(f"delay must be at most {MAX_DELAY_S:.0f} seconds, not {seconds}")
    return seconds
