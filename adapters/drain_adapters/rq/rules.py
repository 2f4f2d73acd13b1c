"""What the RQ backend accepts from a row, checked before anything is sent (no I/O here).

Every check raises ``errors.JobRefused`` with a one-line reason naming the rule, so the row is
rejected (retried, then dead-lettered) instead of RQ or Redis refusing it mid-batch. The rules
follow RQ (2.x) and its worker:

- ``job_name``: the worker resolves it with ``rq.utils.import_attribute``, which imports the
  longest importable module prefix and then walks attributes, and falls back to a *builtin* for a
  name without a dot. So a name must have a dot, and every segment must be a plain ASCII
  identifier that does not start with ``_`` (no ``__builtins__``, no ``__class__`` walks). It
  must then be in ``allowed_jobs``. Because the worker's getattr reaches whatever the module
  *imports* (``app.tasks.check_output`` is ``subprocess.check_output`` if ``app/tasks.py``
  imports it), ``allowed_jobs`` holds exact ``module.function`` names (:func:`allowed_jobs_problems`;
  ``drain allowed-jobs`` lists the functions a module defines). Wildcards (``*``, ``?``,
  ``[...]`` within a segment, matched by ``drain.backend.allowlist``) only with
  ``wildcards_with_checked_workers = true``: the operator's word that every worker runs
  ``drain_adapters.rq.job.CheckedJob``, which refuses an imported callable. ``**`` never.
- ``options`` (a JSON object): ``timeout`` (seconds, -1 = no limit, never 0), ``result_ttl`` and
  ``failure_ttl`` (seconds, 0 = delete at once, -1 = keep forever), ``ttl`` (seconds > 0),
  ``retry`` (``{"max": N >= 1, "interval": S or [S, ...]}``, S >= 0), ``at_front`` (a boolean),
  ``description`` (a string), ``meta`` (an object). Seconds are JSON integers up to
  ``MAX_SECONDS``: the worker arms ``signal.alarm`` (a C int) with the timeout, Redis ``EXPIRE``
  refuses what overflows its millisecond clock, and a retry's ``now + interval`` must stay a date.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

from drain import errors
from drain.backend import allowlist, defined

WILDCARD_CHARACTERS = frozenset("*?[]")
MAX_SECONDS = 2**31 - 1  # signal.alarm's C int; ~68 years, far below EXPIRE's and datetime's limits
FOREVER = -1
KNOWN_OPTIONS = ("timeout", "result_ttl", "ttl", "failure_ttl", "retry", "meta", "description", "at_front")
RETRY_KEYS = frozenset({"max", "interval"})


@dataclasses.dataclass(frozen=True, slots=True)
class RQOptions:
    """A row's options, checked: what goes into the RQ job."""

    timeout: int | None = None
    result_ttl: int | None = None
    ttl: int | None = None
    failure_ttl: int | None = None
    retry_max: int | None = None
    retry_intervals: list[int] | None = None
    at_front: bool = False
    description: str | None = None
    meta: Mapping[str, Any] | None = None


NO_OPTIONS = RQOptions()
_PLAIN_MAPPINGS = (dict, types.MappingProxyType)
"""What a row's options are (drain.store.reading): Mappings known without the ABC's check."""


def is_wildcard(pattern: str) -> bool:
    return not WILDCARD_CHARACTERS.isdisjoint(pattern)


def allowed_jobs_problems(patterns: Sequence[str], *, wildcards: bool) -> list[str]:
    """Why these RQ ``allowed_jobs`` entries are unusable (empty when all are): each must be a
    dotted path of plain identifiers (a row naming anything else is refused anyway), and a
    wildcard needs ``wildcards``. Every wildcard is named in one problem, one line."""
    problems = allowlist.Allowlist.parse(patterns, allow_double_star=False)[1]
    wild = [pattern for pattern in patterns if is_wildcard(pattern)]
    for pattern in patterns:
        if pattern in wild or allowlist.pattern_problem(pattern) is not None:
            continue
        segments = pattern.split(".")
        if len(segments) < 2 or not all(defined.is_public(segment) for segment in segments):
            problems.append(
                f"{pattern!r} is not module.function (plain identifiers, none starting with '_'): "
                "no row could be sent to it"
            )
    if wild and not wildcards:
        shown = ", ".join(repr(pattern) for pattern in wild)
        module = wild[0].rpartition(".")[0]
        module = module if module and not is_wildcard(module) else "app.tasks"
        problems.append(
            f"{shown}: a wildcard admits whatever the module imports, and an RQ worker runs it "
            f"(app.tasks.check_output is subprocess.check_output when app/tasks.py imports it); list "
            f"the functions instead (`drain allowed-jobs {module}` prints them), or run every worker "
            "with --job-class drain_adapters.rq.job.CheckedJob and set "
            "wildcards_with_checked_workers = true"
        )
    return problems


def check_job_name(name: object, allowed: allowlist.Allowlist | None, backend_name: str) -> str:
    """``name`` if an RQ worker may be told to run it, else raise JobRefused saying which rule."""
    if not isinstance(name, str) or not name:
        raise errors.JobRefused("job_name must be a non-empty dotted path")
    segments = name.split(".")
    if len(segments) < 2:
        raise errors.JobRefused(
            f"job_name {name!r} has no dot: an RQ worker would resolve it as a Python builtin; "
            "name a function as module.function"
        )
    for segment in segments:
        if not (segment.isascii() and segment.isidentifier()) or segment.startswith("_"):
            raise errors.JobRefused(
                f"job_name {name!r}: segment {segment!r} is not a plain identifier (ASCII letters, "
                "digits and '_', not starting with '_'): an RQ worker would resolve it"
            )
    if allowed is not None and not allowed.admits(name):
        raise errors.JobRefused(f"job_name {name!r} is not in allowed_jobs of backend {backend_name}")
    return name


def check_options(options: object) -> RQOptions:
    """The row's options as RQ will take them, or raise JobRefused naming the first bad one."""
    if not isinstance(options, _PLAIN_MAPPINGS) and not isinstance(options, Mapping):
        raise errors.JobRefused("RQ options must be a JSON object")
    if not options:
        return NO_OPTIONS
    unknown = sorted(str(key) for key in options if key not in KNOWN_OPTIONS)
    if unknown:
        raise errors.JobRefused(
            f"unknown RQ option(s) {', '.join(unknown)} (known: {', '.join(KNOWN_OPTIONS)})"
        )
    timeout = _seconds(options, "timeout", minimum=1, forever=True)
    result_ttl = _seconds(options, "result_ttl", minimum=0, forever=True)
    failure_ttl = _seconds(options, "failure_ttl", minimum=0, forever=True)
    ttl = _seconds(options, "ttl", minimum=1, forever=False)
    retry_max, retry_intervals = _retry(options.get("retry"))
    at_front = options.get("at_front", False)
    if not isinstance(at_front, bool):
        raise errors.JobRefused(f"RQ option at_front must be true or false, not {_show(at_front)}")
    description = options.get("description")
    if description is not None and not isinstance(description, str):
        raise errors.JobRefused(f"RQ option description must be a string, not {_show(description)}")
    meta = options.get("meta")
    if meta is not None and not isinstance(meta, Mapping):
        raise errors.JobRefused(f"RQ option meta must be an object, not {_show(meta)}")
    return RQOptions(
        timeout=timeout,
        result_ttl=result_ttl,
        ttl=ttl,
        failure_ttl=failure_ttl,
        retry_max=retry_max,
        retry_intervals=retry_intervals,
        at_front=at_front,
        description=description,
        meta=meta,
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seconds(options: Mapping[str, Any], key: str, *, minimum: int, forever: bool) -> int | None:
    value = options.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise errors.JobRefused(f"RQ option {key} must be an integer number of seconds, not {_show(value)}")
    if forever and value == FOREVER:
        return FOREVER
    if not minimum <= value <= MAX_SECONDS:
        hint = f" ({FOREVER} = no limit)" if forever else ""
        raise errors.JobRefused(
            f"RQ option {key} must be between {minimum} and {MAX_SECONDS} seconds{hint}, not {_show(value)}"
        )
    return int(value)


def _retry(retry: object) -> tuple[int | None, list[int] | None]:
    if retry is None:
        return None, None
    shape = 'RQ option retry must be {"max": N >= 1, "interval": SECONDS or [SECONDS, ...]}'
    if not isinstance(retry, Mapping) or not set(retry) <= RETRY_KEYS or "max" not in retry:
        raise errors.JobRefused(shape)
    retry_max = retry["max"]
    if not _is_int(retry_max) or not 1 <= retry_max <= MAX_SECONDS:
        raise errors.JobRefused(f"{shape}; max is {_show(retry_max)}")
    interval = retry.get("interval", 0)
    intervals = interval if isinstance(interval, Sequence) and not isinstance(interval, str) else [interval]
    for each in intervals:
        if not _is_int(each) or not 0 <= each <= MAX_SECONDS:
            raise errors.JobRefused(f"{shape}; interval {_show(each)} is not 0..{MAX_SECONDS}")
    return int(retry_max), [int(each) for each in intervals]


def _show(value: object, limit: int = 40) -> str:
    """A short, safe rendering of a bad value for the reason (never a huge int's digits)."""
    if isinstance(value, int) and abs(value) > 10**12:
        return "a huge integer"
    if isinstance(value, (Mapping, Sequence)) and not isinstance(value, str):
        return f"a JSON {'object' if isinstance(value, Mapping) else 'array'}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
