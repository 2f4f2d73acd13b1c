"""The dashboard and the alert rules use only what the drain exports; promtool accepts the rules."""

from __future__ import annotations

import subprocess

import pytest

from drain.observability import metrics
from tests import conftest
from tests.observability import promql

REQUIRED_ALERTS = {
    "DrainDown",
    "DrainNoLeader",
    "DrainMultipleLeaders",
    "DrainLagHigh",
    "DrainStalled",
    "DrainPublishErrorsHigh",
    "DrainDeadLetters",
    "DrainBacklogHigh",
    "DrainKeyBlocked",
    "DrainLaneNotLed",
    "DrainLaneLedTwice",
    "DrainLanesIndexMissing",
}


def exported_labels() -> set[str]:
    registry = metrics.Metrics().registry
    labels = set(promql.TARGET_LABELS)
    for family in registry.collect():
        for sample in family.samples:
            labels.update(sample.labels)
    return labels | {"backend", "queue", "outcome", "reason", "lane"}


EXPRESSIONS = promql.rule_expressions() + promql.dashboard_expressions()


@pytest.mark.parametrize(("where", "expr"), EXPRESSIONS, ids=[where for where, _ in EXPRESSIONS])
def test_expressions_name_only_exported_metrics(where: str, expr: str) -> None:
    exported = metrics.Metrics().sample_names() | promql.PROMETHEUS_SERIES
    used, labels = promql.names_in(expr)
    assert used, f"{where}: no metric found in {expr!r}"
    assert used <= exported, f"{where}: {sorted(used - exported)} are not exported"
    assert labels <= exported_labels(), f"{where}: unknown labels {sorted(labels - exported_labels())}"


def test_the_name_check_catches_a_renamed_metric() -> None:
    used, _ = promql.names_in('sum(rate(drain_jobs_forwarded_total{outcome="x"}[5m])) > 0')
    assert used == {"drain_jobs_forwarded_total"}
    assert not used <= metrics.Metrics().sample_names()


def test_every_required_alert_exists_with_severity_and_annotations() -> None:
    text = promql.RULES.read_text()
    names = {name for name, _ in promql.rule_expressions()}
    assert names >= REQUIRED_ALERTS
    assert text.count("severity:") == len(names)
    assert text.count("summary:") == len(names) == text.count("description:")


def test_dashboard_covers_the_issue() -> None:
    titles = " ".join(title.lower() for title, _ in promql.dashboard_expressions())
    for topic in ("lag", "throughput", "backlog", "errors", "dead letters", "leader", "batch latency"):
        assert topic in titles
    text = promql.DASHBOARD.read_text()
    assert '"uid": "${datasource}"' in text  # the data source is a template variable


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    """Run promtool in the folder of the rules (deploy/prometheus)."""
    return subprocess.run(
        [conftest.need_binary("promtool", "prometheus"), *args],
        cwd=promql.RULES.parent,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", str(promql.RULES))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_rule_unit_tests_pass() -> None:
    done = promtool("test", "rules", promql.RULE_TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    tested = promql.RULE_TESTS.read_text()
    for alert in {name for name, _ in promql.rule_expressions()}:
        assert f"alertname: {alert}" in tested


def test_the_example_scrape_config_is_valid() -> None:
    done = promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
