"""Who a drain session is, as ``pg_stat_activity.application_name`` shows it.

Every session of a drain process names the version, the process and the host —
``drain/0.2.0 4242@worker-3`` — and the leader's lock session adds since when it leads:
``drain/0.2.0 4242@worker-3 L1764000000`` (Unix seconds). Postgres keeps 63 bytes of an
application name, so the host is shortened to fit. ``drain status`` reads these back.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import socket

from drain.version import __version__

PREFIX = "drain/"
MAX_BYTES = 63  # NAMEDATALEN - 1: Postgres truncates application_name beyond it
_PATTERN = re.compile(r"^drain/(?P<version>\S+) (?P<pid>\d+)@(?P<host>\S*)(?: L(?P<since>\d+))?$")


@dataclasses.dataclass(frozen=True)
class Drain:
    """One drain process, read back from its application name."""

    version: str
    pid: int
    host: str
    since: datetime.datetime | None = None  # the leader's: when it took the lock

    @property
    def process(self) -> str:
        return f"{self.pid}@{self.host}"


def application_name(*, leading_since: float | None = None) -> str:
    """This process's application name (at most 63 bytes, ASCII)."""
    return compose(__version__, os.getpid(), socket.gethostname(), leading_since)


def compose(version: str, pid: int, host: str, leading_since: float | None = None) -> str:
    suffix = "" if leading_since is None else f" L{int(leading_since)}"
    head = f"{PREFIX}{_printable(version)} {pid}@"
    room = MAX_BYTES - len(head) - len(suffix)
    return head + _printable(host)[: max(room, 0)] + suffix


def parse(name: str | None) -> Drain | None:
    """The drain an application name names, or None for any other client."""
    found = _PATTERN.match(name or "")
    if found is None:
        return None
    since = found["since"]
    return Drain(
        version=found["version"],
        pid=int(found["pid"]),
        host=found["host"],
        since=None if since is None else datetime.datetime.fromtimestamp(int(since), datetime.UTC),
    )


def _printable(text: str) -> str:
    """ASCII without spaces or control characters (Postgres shows others as '?')."""
    return "".join(c if c.isascii() and c.isprintable() and not c.isspace() else "?" for c in text)
