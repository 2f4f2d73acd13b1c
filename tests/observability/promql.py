"""The PromQL the dashboard and the alert rules use, and the metric and label names in it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "grafana" / "dashboards" / "drain.json"
RULES = ROOT / "deploy" / "prometheus" / "drain-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "drain-alerts.test.yml"

# Series Prometheus itself makes for every target.
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"job", "instance"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
KEYWORDS |= {"group_left", "group_right", "inf", "nan"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENTIFIER = re.compile(r"(?<![\w.$])([A-Za-z_:][\w:]*)(?!\w)(\s*\()?")


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel."""
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel["targets"]]


def rule_expressions() -> list[tuple[str, str]]:
    """(alert name, expr) for every rule; the file's ``expr:`` is inline or a ``|`` block."""
    found: list[tuple[str, str]] = []
    lines = RULES.read_text().splitlines()
    alert = ""
    for index, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("- alert:"):
            alert = stripped.split(":", 1)[1].strip()
        elif stripped.startswith("expr:"):
            value = stripped.split(":", 1)[1].strip()
            if value == "|":
                indent = len(line) - len(line.lstrip()) + 1
                block = []
                for following in lines[index + 1 :]:
                    if following.strip() and len(following) - len(following.lstrip()) < indent:
                        break
                    block.append(following.strip())
                value = "\n".join(block).strip()
            found.append((alert, value))
    return found


def names_in(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names an expression uses."""
    labels: set[str] = set()
    text = _MATCHERS.sub(lambda m: _matchers(m.group(1), labels), expr)
    text = _STRING.sub(" ", text)
    for match in _GROUPING.finditer(text):
        labels.update(label.strip() for label in match.group(2).split(",") if label.strip())
    text = _GROUPING.sub(" ", text)
    text = _RANGE.sub(" ", text)
    metrics = {
        match.group(1)
        for match in _IDENTIFIER.finditer(text)
        if match.group(2) is None and match.group(1) not in KEYWORDS
    }
    return metrics, labels


def _matchers(body: str, labels: set[str]) -> str:
    labels.update(_MATCHER_LABEL.findall(_STRING.sub('""', body)))
    return " "


def for_grafana(expr: str, rate_interval: str = "30s") -> str:
    """Replace the dashboard's variables as Grafana would, for a query against Prometheus."""
    return expr.replace("$__rate_interval", rate_interval).replace('"$job"', '".*"')
