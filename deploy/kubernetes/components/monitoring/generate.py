"""Write prometheusrule.yaml from deploy/prometheus/drain-alerts.yml: one alert rules file, two forms.

A PrometheusRule's ``spec`` has the shape of a Prometheus rules file (``groups: [...]``), so the
groups are copied as they are. Run from anywhere after editing the rules:

    python deploy/kubernetes/components/monitoring/generate.py

tests/deploy checks that the committed file equals this output, and promtool checks its rules.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE.parents[2] / "prometheus" / "drain-alerts.yml"
OUTPUT = HERE / "prometheusrule.yaml"
HEADER = (
    "# Generated from deploy/prometheus/drain-alerts.yml by generate.py in this folder: edit the rules\n"
    "# file and run it again. The Prometheus Operator loads these rules like a rule_files entry.\n"
)


def render(rules_text: str) -> str:
    """The PrometheusRule manifest (YAML text) for a Prometheus rules file's text."""
    rules: dict[str, Any] = yaml.safe_load(rules_text)
    manifest = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "drain", "labels": {"app.kubernetes.io/name": "drain"}},
        "spec": {"groups": rules["groups"]},
    }
    return HEADER + yaml.safe_dump(manifest, sort_keys=False, width=100, allow_unicode=True)


def main() -> int:
    OUTPUT.write_text(render(RULES.read_text()))
    print(f"wrote {OUTPUT.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
