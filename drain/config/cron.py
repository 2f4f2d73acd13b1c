"""Cron expressions evaluated in a timezone, with the daylight-saving behaviour of Debian's cron.

The parser and evaluator is cronsim (the one Healthchecks.io runs), not a hand-written one.
Expressions have 5 fields (minute hour day-of-month month day-of-week), or 6 with a leading
seconds field. Ticks are computed on the wall clock of the schedule's timezone and handed out
as UTC datetimes. Around a DST change (Debian / Vixie cron semantics):

- spring forward: a job whose fixed time falls in the skipped hour (``30 2 * * *`` on the
  night 02:00 jumps to 03:00) runs once, at the first minute after the change (03:00 local);
- fall back: a job whose fixed time falls in the repeated hour runs once, at its first
  occurrence; a job with a wildcard or a step in the hour field (``30 * * * *``) runs in both
  copies of the hour, as it runs every hour.

Nothing here reads a clock: every function takes the instants it works between.
"""

from __future__ import annotations

import collections
import datetime
import functools
import zoneinfo
from collections.abc import Iterator

import cronsim

UTC = datetime.UTC
# Windows tried when looking for the most recent ticks before an instant, smallest first: the
# ticks are found by walking forward from the window's start, so a small window keeps a schedule
# that ticks every second from walking a year of seconds after a long outage.
_SEARCH_WINDOWS = tuple(
    datetime.timedelta(seconds=seconds) for seconds in (60, 3600, 86_400, 32 * 86_400, 367 * 86_400)
)
MAX_EXPRESSION_CHARS = 200


class CronError(ValueError):
    """A cron expression or timezone that cannot be used; the message says why, in one line."""


def timezone(name: str) -> zoneinfo.ZoneInfo:
    """The IANA timezone ``name`` (``UTC``, ``Europe/Berlin``); CronError if there is none."""
    if not isinstance(name, str) or not name or len(name) > 100 or "\x00" in name:
        raise CronError(f"unknown timezone {name!r}")
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise CronError(f"unknown timezone {name!r}") from None


class Cron:
    """One cron expression in one timezone; construction validates both (CronError)."""

    def __init__(self, expression: str, tz: str = "UTC") -> None:
        if not isinstance(expression, str) or not expression.strip():
            raise CronError("the cron expression is empty")
        if len(expression) > MAX_EXPRESSION_CHARS or "\x00" in expression:
            raise CronError(f"the cron expression is not valid: {expression[:40]!r}...")
        self.expression = expression
        self.tz = timezone(tz)
        try:
            cronsim.CronSim(expression, datetime.datetime(2000, 1, 1, tzinfo=self.tz))
        except cronsim.CronSimError as exc:
            raise CronError(f"the cron expression {expression!r} is not valid: {exc}") from None
        except (ValueError, IndexError, KeyError) as exc:  # the net under the parser's own checks
            raise CronError(f"the cron expression {expression!r} is not valid: {exc}") from None

    def __repr__(self) -> str:
        return f"Cron({self.expression!r}, {self.tz.key!r})"

    def _walk(self, after: datetime.datetime) -> cronsim.CronSim:
        return cronsim.CronSim(self.expression, after.astimezone(self.tz))

    def next_after(self, after: datetime.datetime) -> datetime.datetime | None:
        """The first tick strictly after ``after`` (UTC), or None if there is none for 50 years."""
        try:
            return next(self._walk(after)).astimezone(UTC)
        except StopIteration:
            return None

    def ticks(self, after: datetime.datetime, until: datetime.datetime) -> Iterator[datetime.datetime]:
        """Every tick in (after, until], ascending, as UTC datetimes."""
        for tick in self._walk(after):
            tick_utc = tick.astimezone(UTC)
            if tick_utc > until:
                return
            yield tick_utc

    def recent(
        self, after: datetime.datetime, until: datetime.datetime, limit: int
    ) -> tuple[list[datetime.datetime], bool]:
        """The ``limit`` most recent ticks in (after, until], ascending, and whether older ticks
        of that span were left out. ``limit`` 0 returns no tick (and says whether any exists)."""
        if until <= after:
            return [], False
        kept: collections.deque[datetime.datetime] = collections.deque(maxlen=max(limit, 1))
        start = after
        for window in _SEARCH_WINDOWS:
            start = max(after, until - window)
            kept.clear()
            seen = 0
            for tick in self.ticks(start, until):
                kept.append(tick)
                seen += 1
            if seen >= max(limit, 1) or start == after:
                break
        else:
            start = after
            kept.clear()
            for tick in self.ticks(start, until):
                kept.append(tick)
        if not kept:
            return [], False
        if limit == 0:
            return [], True
        first = self.next_after(after)
        skipped = first is not None and first < kept[0]
        return list(kept), skipped


@functools.cache
def parse(expression: str, tz: str = "UTC") -> Cron:
    """A cached Cron for this expression and timezone (CronError if either is bad)."""
    return Cron(expression, tz)
