"""Loading: a TOML file, ``DRAIN_*`` environment variables and command-line flags, into Settings.

Precedence, highest first: flag > ``DRAIN_*`` variable > file > default. The database URL comes from
``--dsn``, ``DRAIN_DSN``, the file, ``DATABASE_URL``, then libpq's own ``PG*`` variables. String values
in the file may say ``${NAME}`` to take a secret from the environment. Nothing here reads the
environment by itself: callers pass it in. The variables are :mod:`drain.config.environment`'s;
the merged mapping is validated by :mod:`drain.config.parsing`. Settings remember where each value
came from (``Settings.sources``) for ``drain check --show-config``.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from drain import errors
from drain.config import environment, parsing
from drain.config.settings import Settings
from drain.observability import redaction

_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _substitute(value: Any, key: str, env: Mapping[str, str], problems: list[str]) -> Any:
    if isinstance(value, str):

        def replace(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in env:
                problems.append(f"{key}: environment variable {name} is not set")
                return ""
            return env[name]

        return _ENV_REFERENCE.sub(replace, value)
    if isinstance(value, dict):
        return {k: _substitute(v, f"{key}.{k}" if key else k, env, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(item, key, env, problems) for item in value]
    return value


def _read_file(path: str | Path, env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's data, and as written (before ``${NAME}`` substitution)."""
    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError:
        raise errors.ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise errors.ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except (ValueError, RecursionError) as exc:  # an integer past 4300 digits, arrays nested too deep
        raise errors.ConfigError(f"config file {path} is not valid TOML: {type(exc).__name__}") from None
    problems: list[str] = []
    data: dict[str, Any] = _substitute(raw, "", env, problems)
    if problems:
        raise errors.ConfigError(problems)
    return data, raw


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _file_sources(raw: Mapping[str, Any], prefix: str, sources: dict[str, str]) -> None:
    """``file``, or ``file ${NAME}`` for a value that takes a variable."""
    for key, value in raw.items():
        if isinstance(value, dict) and (prefix or key in environment.SECTION_KEYS or key == "backends"):
            _file_sources(value, f"{prefix}{key}.", sources)
        else:
            names = dict.fromkeys(name for text in _strings(value) for name in _ENV_REFERENCE.findall(text))
            sources[f"{prefix}{key}"] = " ".join(["file", *(f"${{{name}}}" for name in names)])


def _with_variables(problem: str, sources: Mapping[str, str]) -> str:
    """``problem`` (``key: message``), naming the variable that set the key or a key it mentions."""
    head = problem.split(": ", 1)[0]
    candidates = [head]
    candidates += [head[: match.start()] for match in re.finditer(r"[.\[]", head)]
    # a key missing from a section that only variables made (a backend without its type)
    parent = head.rpartition(".")[0]
    siblings = [key for key in sources if parent and key.startswith(f"{parent}.")]
    only_env = bool(siblings) and all(sources[key].startswith("env ") for key in siblings)
    named = [
        sources[key][len("env ") :]
        for key in sources
        if sources[key].startswith("env ")
        and (
            key in candidates
            or (only_env and key in siblings)
            or (("_" in key or "." in key) and re.search(rf"(?<![\w.]){re.escape(key)}(?![\w.])", problem))
        )
    ]
    named = [variable for variable in dict.fromkeys(named) if variable not in problem]
    text = f"{problem} (from {', '.join(named)})" if named else problem
    text = redaction.redact(text)  # a secret given to the wrong key
    return text.replace("\r", "\\r").replace("\n", "\\n")


def load(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build Settings from a file, the environment and flag overrides; report every problem at once.

    ``env`` defaults to no environment at all; the CLI passes ``os.environ``. A problem with a
    value that a variable set names that variable.
    """
    env = env or {}
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    referenced: set[str] = set()
    path = path or env.get("DRAIN_CONFIG")
    if path:
        data, raw = _read_file(path, env)
        referenced = {name for text in _strings(raw) for name in _ENV_REFERENCE.findall(text)}
        _file_sources(raw, "", sources)
    problems = environment.apply_environment(data, env, referenced, sources)
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
            sources[key] = f"flag --{key.replace('_', '-')}"
    try:
        settings = parsing.parse(data, env=env)
    except errors.ConfigError as exc:
        problems += exc.problems
    if problems:
        raise errors.ConfigError([_with_variables(problem, sources) for problem in problems])
    if "dsn" not in sources and env.get("DATABASE_URL"):
        sources["dsn"] = "env DATABASE_URL"
    return dataclasses.replace(settings, sources=sources)
