"""The lines the commands write outside logging: one-line messages on stderr, timestamps."""

from __future__ import annotations

import json
import sys
from typing import Any

from drain.observability import logs

# The format of the lines written outside logging: the config's once loaded, before that the
# flag's or DRAIN_LOG_FORMAT's (a config that fails to load cannot say), else text.
_stderr = {"format": logs.TEXT}


def set_format(log_format: str) -> None:
    """Write the lines below (and the signal handlers' lines) in this log format from now on."""
    _stderr["format"] = log_format


def stderr_format() -> str:
    """The log format of the lines on stderr now (see set_format)."""
    return _stderr["format"]


def say(message: str) -> None:
    """One line on stderr: ``drain: message``, or with log_format json a JSON object (level ERROR)."""
    sys.stderr.write(logs.render(message, _stderr["format"]))


def when(value: Any) -> str:
    """A timestamp as ISO 8601, or as Postgres wrote it when ``datetime`` cannot hold it."""
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def key(value: str | None) -> str:
    """An ordering key on one line: JSON-quoted (a key may hold tabs, newlines, quotes), or none."""
    return "none" if value is None else json.dumps(value, ensure_ascii=False)
