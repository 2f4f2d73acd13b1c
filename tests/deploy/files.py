"""Paths of the deployment files, and small readers shared by the tests in tests/deploy."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
KUBERNETES = DEPLOY / "kubernetes"
BASE = KUBERNETES / "base"
WITH_MONITORING = KUBERNETES / "with-monitoring"
MONITORING = KUBERNETES / "components" / "monitoring"
UNIT = DEPLOY / "systemd" / "drain.service"
UNIT_ENV = DEPLOY / "systemd" / "drain.env.example"
EXAMPLE_CONFIG = DEPLOY / "drain.example.toml"
GRANTS = DEPLOY / "database" / "drain-role.sql"
PRODUCER_GRANTS = DEPLOY / "database" / "producer-role.sql"
RULES = DEPLOY / "prometheus" / "drain-alerts.yml"


def env_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= and kustomize's envs read them (no expansion)."""
    found: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {raw!r}"
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()), f"bad variable name: {key!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        found[key.strip()] = value
    return found


def unit_settings(text: str) -> dict[str, list[str]]:
    """``Section.Key`` -> every value given, in order (systemd allows repeated keys)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return settings


def exec_start(text: str) -> list[str]:
    """The unit's ExecStart= as argv. Only a plain line is accepted: no prefixes, specifiers or $."""
    (line,) = unit_settings(text)["Service.ExecStart"]
    assert not re.search(r"[%$@\-:+!|]", line[:1]) and "%" not in line and "$" not in line, line
    return shlex.split(line)
