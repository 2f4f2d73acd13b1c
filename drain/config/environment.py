"""The ``DRAIN_*`` environment variables: which setting each one sets, and what its text means.

Every key has a variable: ``DRAIN_<KEY>`` for a top-level key, ``DRAIN_<SECTION>__<KEY>`` for a key
of a table (``DRAIN_METRICS__LISTEN``), ``DRAIN_BACKENDS__<NAME>__<KEY>`` for a backend's key, and
``DRAIN_SCHEDULES`` for the whole ``[[schedules]]`` array. A variable's text is read as a TOML value
when it is one (``500``, ``true``, ``["a", "b"]``, ``{ max = 3 }``), and as the text itself
otherwise; a string key takes the text as it is (or unquoted, when it is a TOML string).

A ``DRAIN_*`` variable that sets nothing is refused, with the nearest variable that does as a hint
(a typo must not go unnoticed), except the few drain reads elsewhere, ``DRAIN_TEST_*``, and the
variables Kubernetes puts in every pod for a Service named ``drain``.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import json
import re
import tomllib
from collections.abc import Mapping
from typing import Any

from drain.config.settings import Settings

ENVIRONMENT_PREFIX = "DRAIN_"
SCHEDULES_VARIABLE = "DRAIN_SCHEDULES"
SECTION_KEYS: Mapping[str, tuple[str, ...]] = {"metrics": ("listen",)}
_ALIASES: Mapping[str, tuple[str, str]] = {"DRAIN_METRICS_LISTEN": ("metrics", "listen")}
_NOT_SETTINGS = frozenset({"DRAIN_CONFIG", "DRAIN_FAILPOINTS", "DRAIN_EXTRAS", "DRAIN_CONSOLE_TOKEN"})
_NOT_SETTINGS_PREFIX = "DRAIN_TEST_"
# What Kubernetes puts in every pod for a Service named drain or drain-*: never a setting.
_SERVICE_LINK = re.compile(
    r"^DRAIN(?:_[A-Z0-9]+)*_(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9]+)*"
    r"|PORT(?:_[0-9]+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)?)$"
)
NOT_TOP_LEVEL = frozenset({"backends", "schedules", "metrics_listen", "sources"})
"""The fields of Settings that are no top-level key of the file."""


def top_level_keys() -> tuple[str, ...]:
    """Every top-level key of the file, each settable as ``DRAIN_<KEY>``."""
    return tuple(field.name for field in dataclasses.fields(Settings) if field.name not in NOT_TOP_LEVEL)


def _string_keys() -> frozenset[str]:
    """Top-level keys whose value is text: a variable's text is taken as is (no TOML reading)."""
    return frozenset(
        field.name
        for field in dataclasses.fields(Settings)
        if str(field.type).replace(" ", "") in ("str", "str|None")
    ) | {f"{section}.{key}" for section, keys in SECTION_KEYS.items() for key in keys}


def environment_variable(key: str) -> str:
    """The variable that sets dotted ``key``: ``batch_size`` → ``DRAIN_BATCH_SIZE``,
    ``metrics.listen`` → ``DRAIN_METRICS__LISTEN``, ``backends.default.url`` →
    ``DRAIN_BACKENDS__DEFAULT__URL``."""
    return ENVIRONMENT_PREFIX + "__".join(part.upper() for part in key.split("."))


def environment_value(text: str, *, string: bool = False) -> Any:
    """A variable's text as the value it denotes.

    A TOML value (``10``, ``0.5``, ``true``, ``["a", "b"]``, ``{ max = 3 }``, ``"quoted"``) is read
    as one; any other text (``redis://h/0``, ``rq``, a date) is the string itself. With ``string``
    (a key whose value is text), only a quoted TOML string is read, so ``DRAIN_TABLE=true`` is the
    table ``true``.
    """
    try:
        parsed = tomllib.loads(f"value = {text}")
    except (tomllib.TOMLDecodeError, ValueError, RecursionError):
        return text
    value = parsed.get("value")
    if set(parsed) != {"value"} or isinstance(value, (datetime.date, datetime.time)):
        return text  # "1\nother = 2" is not one value; dates are no setting's type
    if string and not isinstance(value, str):
        return text
    return value


def _schedules_value(text: str) -> Any:
    """``DRAIN_SCHEDULES``: a TOML array of inline tables, or the same as JSON."""
    value = environment_value(text)
    if isinstance(value, str):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            return text  # reported by parse(): schedules must be an array of tables
    return value


def _known_variables() -> list[str]:
    names = [environment_variable(key) for key in top_level_keys()]
    names += [environment_variable(f"{s}.{k}") for s, keys in SECTION_KEYS.items() for k in keys]
    return [*names, *_ALIASES, SCHEDULES_VARIABLE, "DRAIN_BACKENDS__<NAME>__<KEY>", *sorted(_NOT_SETTINGS)]


def _unknown(variable: str) -> str:
    guess = difflib.get_close_matches(variable, _known_variables(), n=1, cutoff=0.75)
    hint = f"did you mean {guess[0]}?" if guess else "see docs/reference/configuration.md"
    return f"{variable}: no setting has this variable ({hint}); unset it"


def apply_environment(
    data: dict[str, Any], env: Mapping[str, str], referenced: set[str], sources: dict[str, str]
) -> list[str]:
    """Merge every ``DRAIN_*`` setting of ``env`` into ``data`` (the file's shape); return problems.

    An empty variable counts as unset. A ``DRAIN_*`` variable that sets nothing is a problem
    (a typo must not go unnoticed), unless drain reads it elsewhere (``DRAIN_CONFIG``,
    ``DRAIN_FAILPOINTS``), the file references it as ``${NAME}``, it is ``DRAIN_TEST_*``, or it is
    one of the variables Kubernetes defines for a Service named ``drain``.
    """
    problems: list[str] = []
    top = set(top_level_keys())
    strings = _string_keys()
    variables = sorted(name for name in env if name.startswith(ENVIRONMENT_PREFIX) and env[name])
    # the old spelling first, so that the canonical one wins when both are set
    variables.sort(key=lambda name: name not in _ALIASES)
    for variable in variables:
        text = env[variable]
        if variable == SCHEDULES_VARIABLE:
            data["schedules"] = _schedules_value(text)
            sources["schedules"] = f"env {variable}"
            continue
        path = _path(variable, top, data)
        if isinstance(path, str):
            problems.append(path)
        elif path is None:
            if not _read_elsewhere(variable, referenced):
                problems.append(_unknown(variable))
        else:
            dotted = ".".join(path)
            if _put(data, path, environment_value(text, string=dotted in strings)):
                sources[dotted] = f"env {variable}"
    return problems


def _path(variable: str, top: set[str], data: Mapping[str, Any]) -> tuple[str, ...] | str | None:
    """Where ``variable`` sets a value in the file's shape (``("backends", "default", "url")``);
    a problem when it names a backend's key badly; None when it names no setting."""
    if variable in _ALIASES:
        return _ALIASES[variable]
    parts = variable[len(ENVIRONMENT_PREFIX) :].split("__")
    head = parts[0].lower()
    if len(parts) == 1 and head in top:
        return (head,)
    if len(parts) == 2 and parts[1].lower() in SECTION_KEYS.get(head, ()):
        return (head, parts[1].lower())
    if head != "backends":
        return None
    name, key = "__".join(parts[1:-1]).lower(), parts[-1].lower()
    if len(parts) < 3 or not name or not key:
        return f"{variable}: a backend's key is set by DRAIN_BACKENDS__<NAME>__<KEY>"
    found = data.get("backends")
    matches = [given for given in found if given.lower() == name] if isinstance(found, dict) else []
    if len(matches) > 1:
        return f"{variable}: the file has backends {' and '.join(sorted(matches))}; rename one"
    return ("backends", matches[0] if matches else name, key)


def _read_elsewhere(variable: str, referenced: set[str]) -> bool:
    """Whether a ``DRAIN_*`` variable that sets no setting is still no typo."""
    return bool(
        variable in _NOT_SETTINGS
        or variable in referenced
        or variable.startswith(_NOT_SETTINGS_PREFIX)
        or _SERVICE_LINK.match(variable)
    )


def _put(data: dict[str, Any], path: tuple[str, ...], value: Any) -> bool:
    """Set ``value`` at ``path`` in ``data``, making the tables on the way; False when the file
    already has something else than a table there (the file's own mistake, which parse() reports)."""
    table = data
    for part in path[:-1]:
        inner = table.setdefault(part, {})
        if not isinstance(inner, dict):
            return False
        table = inner
    table[path[-1]] = value
    return True
