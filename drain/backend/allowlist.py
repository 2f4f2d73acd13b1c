"""``allowed_jobs``: which job names a backend may forward. A security boundary, not a filter.

Whoever can INSERT into the staged-jobs table chooses ``job_name``; an RQ worker imports and
calls whatever dotted path it is given, and a Celery worker runs whatever registered task is
named. A backend's ``allowed_jobs`` limits that to the patterns an operator wrote. For RQ a
pattern with a wildcard admits whatever the module *imports*, so the RQ backend takes exact
names unless its workers check (``drain_adapters.rq.rules.allowed_jobs_problems``).

Patterns match dotted names **segment by segment**:

- a segment of the pattern matches exactly one segment of the name, with ``*``, ``?`` and
  ``[...]`` as in shell globs *within* that segment: ``*`` never crosses a dot, so
  ``app.tasks.*`` admits ``app.tasks.send_email`` and never ``app.tasks.os.system``;
- a whole segment ``**`` matches zero or more segments (``app.**`` admits every name under
  ``app``); a backend may refuse ``**`` when its worker resolves attribute chains (RQ does).

Matching is case-sensitive. A name with an empty segment (``app..x``, ``.x``, ``x.``) never
matches.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from collections.abc import Sequence

DOUBLE_STAR = "**"


@functools.cache
def _segment_regex(segment: str) -> re.Pattern[str]:
    return re.compile(fnmatch.translate(segment))


def _matches(pattern: Sequence[str], name: Sequence[str]) -> bool:
    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == DOUBLE_STAR:
        return any(_matches(rest, name[skip:]) for skip in range(len(name) + 1))
    return bool(name) and _segment_regex(head).match(name[0]) is not None and _matches(rest, name[1:])


def pattern_problem(pattern: str, *, allow_double_star: bool = True) -> str | None:
    """Why ``pattern`` is not a usable allowed_jobs pattern, or None."""
    segments = pattern.split(".")
    if any(not segment for segment in segments):
        return f"pattern {pattern!r} has an empty segment"
    for segment in segments:
        if DOUBLE_STAR in segment and segment != DOUBLE_STAR:
            return f"pattern {pattern!r}: '**' must be a whole segment"
        if segment == DOUBLE_STAR and not allow_double_star:
            return (
                f"pattern {pattern!r}: '**' is not allowed for this backend (its worker resolves "
                "attribute chains); list each module, e.g. 'app.tasks.*'"
            )
    return None


@dataclasses.dataclass(frozen=True)
class Allowlist:
    """Compiled ``allowed_jobs`` patterns. Build with :meth:`parse`."""

    patterns: tuple[str, ...]

    @classmethod
    def parse(cls, patterns: Sequence[str], *, allow_double_star: bool = True) -> tuple[Allowlist, list[str]]:
        """The allowlist and the problems of its patterns (empty when all are usable)."""
        problems = [
            problem
            for pattern in patterns
            if (problem := pattern_problem(pattern, allow_double_star=allow_double_star)) is not None
        ]
        return cls(tuple(patterns)), problems

    def admits(self, job_name: str) -> bool:
        """Whether some pattern matches ``job_name`` segment by segment."""
        name = job_name.split(".")
        if any(not segment for segment in name):
            return False
        return any(_matches(tuple(pattern.split(".")), tuple(name)) for pattern in self.patterns)
