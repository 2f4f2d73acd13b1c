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


_HIDDEN = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs"))
"""Unicode categories a terminal acts on or hides: controls (ESC starts a sequence that can
retitle, recolour or rewrite the screen; C1's CSI does too), format characters (bidi overrides
reorder what is shown), line and paragraph separators, lone surrogates."""


def shown(text: str) -> str:
    """Text a row holds (a job name, a queue, a stored error), safe to print on one line of a
    terminal: each control, format or separator character as its escape (``\\x1b``,
    ``\\u202e``), the rest as it is. A row is the app's to fill, and an operator reads these."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(_escape(char) if unicodedata.category(char) in _HIDDEN else char for char in text)


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
