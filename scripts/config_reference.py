"""The configuration reference of the docs, generated from the settings themselves.

Every row comes from ``drain.config``: the keys are ``Settings``' fields (``top_level_keys()``),
the variables ``environment_variable()``, the defaults the fields' defaults, the ranges ``LIMITS``
and the meanings the fields' docstrings (read from the source with ``ast``). Nothing is written by
hand, so the page cannot drift from the code.

Used two ways: as an MkDocs hook (``mkdocs.yml`` ``hooks:``), which fills the page
``docs/reference/configuration.md`` at its ``<!-- generated: configuration keys -->`` marker on
every build; and from the tests (``markdown()``). ``python scripts/config_reference.py`` prints it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
from typing import Any

from drain import config

MARKER = "<!-- generated: configuration keys -->"
PAGE = "reference/configuration.md"


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal after it in the class body), joined into one line."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for statement, following in itertools.pairwise(body):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _bytes(value: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size and value % size == 0:
            return f"{int(value // size)} {unit}"
    return f"{int(value)} B"


def _seconds(value: float) -> str:
    days = value / 86400
    if value >= 86400 and days.is_integer():
        return {1: "a day", 7: "a week"}.get(int(days), f"{int(days)} days")
    return ""


def value_range(key: str, low: float, high: float) -> str:
    text = f"{_number(low)}–{_number(high)}"
    if key.endswith("_bytes"):
        return f"{text} ({_bytes(low)}–{_bytes(high)})"
    if key.endswith("_s") and _seconds(high):
        return f"{text} ({_seconds(high)})"
    return text


def default(key: str, value: Any) -> str:
    if key == "watchdog_s":
        return "derived"
    if value is None or value == "":
        return "—" if key == "dsn" else "off"
    if isinstance(value, str):
        return f"`{value}`"
    if key.endswith("_bytes"):
        return f"{value} ({_bytes(value)})"
    return _number(value) if isinstance(value, float) else str(value)


def _links(text: str) -> str:
    """The docstrings link relative to the docs' root; the page is one level down."""
    return re.sub(r"\]\((?!https?://|#)([^)]+)\)", r"](../\1)", text)


def _cell(text: str) -> str:
    return _links(text).replace("|", "\\|")


def rows() -> list[tuple[str, str, str, str, str]]:
    """(key, variable, default, range, meaning) for every key, in the order of ``Settings``."""
    docs = field_docs(config.Settings)
    defaults = {field.name: field.default for field in dataclasses.fields(config.Settings)}
    found = []
    for key in config.top_level_keys():
        low_high = config.LIMITS.get(key)
        found.append(
            (
                f"`{key}`",
                f"`{config.environment_variable(key)}`",
                default(key, defaults[key]),
                value_range(key, *low_high) if low_high else "",
                _cell(docs[key]),
            )
        )
    found.append(
        (
            "`[metrics] listen`",
            f"`{config.environment_variable('metrics.listen')}`",
            "off",
            "",
            _cell(docs["metrics_listen"].removeprefix("`[metrics] listen`: ")),
        )
    )
    found.append(
        (
            "`[backends.NAME]`",
            f"`{config.environment_variable('backends.NAME.KEY')}`",
            "—",
            "",
            _cell(docs["backends"].removeprefix("`[backends.NAME]`: ")),
        )
    )
    return found


def schedule_rows() -> list[tuple[str, str, str]]:
    """(key, default, meaning) for each key of a ``[[schedules]]`` entry."""
    docs = field_docs(config.ScheduleSettings)
    found = []
    for field in dataclasses.fields(config.ScheduleSettings):
        if field.default is not dataclasses.MISSING:
            value = default(field.name, field.default)
        elif field.default_factory is not dataclasses.MISSING:
            value = f"`{field.default_factory()}`"
        else:
            value = "required"
        if field.name == "args":
            value = "`[]`"
        meaning = docs[field.name]
        if field.name == "catch_up_max":
            meaning += f" ({_number(1)}–{_number(config.MAX_CATCH_UP_MAX)})"
        found.append((f"`{field.name}`", value, _cell(meaning)))
    return found


def markdown() -> str:
    """The generated part of the page: the keys' table, then the schedules' keys."""
    lines = [
        "| key | variable | default | range | meaning |",
        "|---|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in rows()),
        "",
        "`backends.NAME.KEY` stands for each backend key"
        f" (`{config.environment_variable('backends.events.url')}` sets `[backends.events] url`)."
        " Each `[[schedules]]` entry (`DRAIN_SCHEDULES` replaces the whole array) takes:",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in schedule_rows()),
    ]
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown_text: str, page: Any, **_: Any) -> str:
    """MkDocs hook: fill the marker of the reference page."""
    if page.file.src_uri != PAGE:
        return markdown_text
    if MARKER not in markdown_text:
        raise ValueError(f"{PAGE}: the marker {MARKER!r} is missing")
    return markdown_text.replace(MARKER, markdown())


if __name__ == "__main__":
    print(markdown(), end="")
