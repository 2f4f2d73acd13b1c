"""The lines the commands write outside logging: one-line messages on stderr, timestamps."""

from __future__ import annotations

import json
import sys
import unicodedata
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
    """An ordering key on one line: JSON-quoted (a key may hold tabs, newlines, quotes), or none;
    characters a terminal would act on escaped (:func:`shown`)."""
    return "none" if value is None else shown(json.dumps(value, ensure_ascii=False))


def shown(text: str) -> str:
    """Text a row holds (a job name, a queue, a stored error), safe to print on one line of a
    terminal: what logs.one_line escapes (controls, ESC and C1's CSI among them, line separators,
    lone surrogates) and the format characters (bidi overrides reorder what is shown), each as its
    escape (``\\x1b``, ``\\u202e``). A row is the app's to fill, and an operator reads these."""
    text = logs.one_line(text)
    if text.isascii():
        return text
    return "".join(
        char.encode("unicode_escape").decode("ascii") if unicodedata.category(char) == "Cf" else char
        for char in text
    )
