"""A row's text as the console shows it: inert and bounded, whatever the app put in it.

- Autoescaping (Jinja2) makes markup text; these functions handle what escaping leaves.
- Every control, format (bidi overrides, zero-width), separator and surrogate character, and
  every other character that renders as nothing (Unicode's default-ignorable code points, the
  Hangul fillers, a braille blank), is shown as its escape (``\\u202e``), so what is shown is
  what is stored, in its order.
- Every value is cut to a number of characters and says how many it left out.
- A name, a queue, a key is shown with any password in it masked (:func:`field`), as an error is.
- Arguments are shown with their secrets masked (redaction.masked); arguments whose secrets
  cannot be masked (JSON Python cannot read, or nested too deep to walk) are shown as their size
  only.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

from drain.observability import redaction

FIELD_CHARS = 200  # a name, a queue, a key in a list
ERROR_CHARS = 300  # an error in a list
FULL_CHARS = 65_536  # one value on a dead letter's own page
_HIDDEN = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")
# letters, marks and symbols that render as nothing: Unicode's Default_Ignorable_Code_Point
# outside Cf/Cn (combining grapheme joiner, Hangul fillers, Khmer inherent vowels, Mongolian
# and other variation selectors, tag characters) and the braille blank
_BLANK = frozenset(
    [
        *(0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x2800, 0x3164, 0xFFA0),
        *range(0x180B, 0x1810),
        *range(0xFE00, 0xFE10),
        *range(0xE0100, 0xE01F0),
    ]
)


def inert(value: object, limit: int = FIELD_CHARS, *, lines: bool = False) -> str:
    """``value`` as text of at most ``limit`` characters (and a note of how many more), each
    invisible or reordering character as its escape; newlines kept if ``lines``."""
    text = "" if value is None else str(value)
    rest = len(text) - limit
    text = text[:limit]
    shown = "".join(
        char if _plain(char, lines) else char.encode("unicode_escape", "backslashreplace").decode("ascii")
        for char in text
    )
    return shown if rest <= 0 else f"{shown} … ({rest:,} more characters)"


def field(value: object, limit: int = FIELD_CHARS) -> str:
    """A row's or the drain's own text (a job name, a queue, an ordering key, a host) as a page
    shows it: any password in it masked (redaction.masked), then :func:`inert`."""
    return inert(None if value is None else redaction.masked(str(value)), limit)


def _plain(char: str, lines: bool) -> bool:
    if char.isascii():
        return char.isprintable() or (lines and char == "\n")
    return unicodedata.category(char) not in _HIDDEN and ord(char) not in _BLANK


def pretty(value: Any, limit: int = FULL_CHARS) -> str:
    """A JSON value (the arguments, the options), secrets masked (redaction.masked: URL passwords,
    the value of any key named like a secret), indented, inert and bounded; one whose secrets
    cannot be masked, as its size (:func:`unmaskable`)."""
    try:
        if isinstance(value, str):
            return unmaskable(value)
        return inert(
            json.dumps(redaction.masked(value), ensure_ascii=False, indent=2, default=str), limit, lines=True
        )
    except RecursionError:
        return unmaskable(value)


def error(value: object, limit: int = ERROR_CHARS) -> str:
    """A stored error: passwords redacted (redaction.redact), inert and bounded."""
    return inert(redaction.redact("" if value is None else str(value)), limit, lines=limit > ERROR_CHARS)


def brief(value: Any, limit: int = FIELD_CHARS) -> str:
    """A JSON value on one line, secrets masked as :func:`pretty` does, inert and bounded."""
    try:
        if isinstance(value, str):
            return unmaskable(value)
        return inert(json.dumps(redaction.masked(value), ensure_ascii=False, default=str), limit)
    except RecursionError:
        return unmaskable(value)


def unmaskable(value: Any) -> str:
    """What is shown of arguments whose secret-named keys cannot be found, so cannot be masked:
    JSON Python cannot read (given as its text: nested deeper than the recursion limit, a number
    of more digits than int takes) or nested too deep to walk. Their size only, never a piece."""
    size = f"{len(value):,} characters of JSON" if isinstance(value, str) else "JSON"
    return f"({size} nested too deep or too long to read: not shown, as its secrets cannot be masked)"
