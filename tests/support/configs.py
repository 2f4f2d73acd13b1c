"""The one way tests write a drain.toml: core settings plus any number of backend sections.

Values are written as JSON scalars and arrays, which are valid TOML for strings, numbers,
booleans and lists of them; a mapping becomes an inline table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TEST_DEFAULTS: Mapping[str, Any] = {
    "batch_size": 50,
    "poll_max_s": 0.2,
    "standby_retry_s": 0.3,
    "retry_base_s": 0.05,
    "log_repeat_s": 0,  # every warning written: tests count them (a test of the repeat filter sets it)
}


def rq(
    url: str,
    allowed_jobs: Sequence[str] = ("tests.support.faultload.noop", "tests.support.tasks.record"),
    **keys: Any,
) -> dict[str, Any]:
    """A ``type = "rq"`` backend section."""
    return {"type": "rq", "url": url, "allowed_jobs": list(allowed_jobs), **keys}


def memory(**keys: Any) -> dict[str, Any]:
    """A ``type = "memory"`` backend section (the in-package test backend)."""
    return {"type": "memory", **keys}


def rabbitmq(url: str, **keys: Any) -> dict[str, Any]:
    """A ``type = "rabbitmq"`` backend section (the default exchange unless ``exchange`` is given)."""
    return {"type": "rabbitmq", "url": url, **keys}


def toml_value(value: Any) -> str:
    """``value`` as TOML: JSON for scalars and lists, an inline table for a mapping."""
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + " }"
    return json.dumps(value)


def write_config(
    path: Path, dsn: str, backends: Mapping[str, Mapping[str, Any]], *, extra_toml: str = "", **settings: Any
) -> Path:
    """Write ``path``: ``dsn``, TEST_DEFAULTS overridden by ``settings``, ``extra_toml`` (e.g.
    ``[[schedules]]`` tables), then one ``[backends.NAME]`` section per entry of ``backends``.
    Returns ``path``."""
    lines = [f"dsn = {json.dumps(dsn)}"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in {**TEST_DEFAULTS, **settings}.items()]
    if extra_toml:
        lines += ["", extra_toml.strip()]
    for name, section in backends.items():
        lines += ["", f"[backends.{name}]"]
        lines += [f"{key} = {toml_value(value)}" for key, value in section.items()]
    path.write_text("\n".join(lines) + "\n")
    return path
