"""``drain check --show-config``: every effective setting, its value as TOML and where it came from.

Secrets never appear (drain.observability.redaction).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from drain.config.environment import NOT_TOP_LEVEL
from drain.config.settings import ScheduleSettings, Settings
from drain.observability import redaction


def describe(settings: Settings) -> list[tuple[str, str, str]]:
    """Every effective key as ``(dotted key, value, source)``, for ``drain check --show-config``.

    The value is written as in TOML; the source is ``default``, ``file``, ``env DRAIN_...`` or
    ``flag --...``. Secrets never appear (:func:`drain.observability.redaction.masked`): a password
    in a URL or a DSN is ``***``, and so is the whole value of a key whose name says secret
    (:func:`drain.observability.redaction.is_secret_name`: password, token, an API key, ...). A
    backend's keys are those configured; the adapter's defaults apply to the others.
    """
    sources = settings.sources
    rows: list[tuple[str, str, str]] = []

    def add(key: str, value: Any, source: str | None = None) -> None:
        secret = redaction.is_secret_name(key.rsplit(".", 1)[-1]) and value
        shown = redaction.MASK if secret else redaction.masked(value)
        rows.append((key, _toml(shown), source or sources.get(key, "default")))

    for field in dataclasses.fields(Settings):
        if field.name in NOT_TOP_LEVEL:
            continue
        value = getattr(settings, field.name)
        if field.name == "watchdog_s" and value is None:
            derived = f"default: derived from the timeouts, {settings.watchdog_bound_s():g} s"
            add("watchdog_s", 0, sources.get("watchdog_s", derived))
        elif field.name == "dsn" and not value:
            add("dsn", value, "default: libpq's PG* variables")
        else:
            add(field.name, value)
    listen = settings.metrics_listen
    add("metrics.listen", listen if listen is not None else "", None if listen else "default: off")
    for name, section in settings.backends.items():
        prefix = f"backends.{name}."
        add(f"{prefix}type", section.type)
        attempts = sources.get(f"{prefix}max_attempts") or f"{sources.get('max_attempts', 'default')}"
        add(f"{prefix}max_attempts", section.max_attempts, attempts)
        add(f"{prefix}block_on_dead_letter", section.block_on_dead_letter)
        for key, value in section.options.items():
            add(f"{prefix}{key}", value)
    source = sources.get("schedules", "default")
    for schedule in settings.schedules:
        for field in dataclasses.fields(ScheduleSettings):
            add(f"schedules.{schedule.name}.{field.name}", getattr(schedule, field.name), source)
    return rows


def _toml(value: Any) -> str:
    """``value`` written as a TOML value (any string escaped, so one line)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, Mapping):
        items = ", ".join(f"{json.dumps(str(key))} = {_toml(item)}" for key, item in value.items())
        return f"{{ {items} }}" if items else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if value is None:
        return '""'
    text = json.dumps(str(value), ensure_ascii=False)
    return "".join(char if char.isprintable() else _escaped(char) for char in text)


def _escaped(char: str) -> str:
    code = ord(char)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
