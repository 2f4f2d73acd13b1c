"""A real Prometheus scrapes two real `drain run` processes while jobs flow through RQ.

Every metric the dashboard and the alert rules use must exist and have data, every panel's query
must return data, the rules must load and evaluate cleanly, and the forwarded count must equal
the jobs staged.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import drain
from tests import conftest
from tests.observability import promql
from tests.support import faultload
from tests.support.waiting import wait_until

GOOD_JOBS = 40
BAD_JOBS = 3
DEADLINE_S = 120.0


def prometheus_binary() -> str:
    return conftest.need_binary("prometheus", "prometheus")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def drains(tmp_path: Path, database: str, redis_db: str) -> Iterator[list[int]]:
    """Two `drain run` processes (a leader and a standby) on one table; their metrics ports."""
    ports = [faultload.free_port(), faultload.free_port()]
    processes = []
    executable = str(Path(sys.executable).with_name("drain"))
    for index, port in enumerate(ports):
        config = tmp_path / f"drain-{index}.toml"
        config.write_text(
            f'dsn = "{database}"\n'
            "poll_max_s = 0.5\nstandby_retry_s = 0.5\n"
            "[backends.default]\n"
            f'type = "rq"\nurl = "{redis_db}"\nmax_attempts = 1\n'
            'allowed_jobs = ["app.tasks.work", "app.tasks.later"]\n'
            f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
        )
        log = (tmp_path / f"drain-{index}.log").open("wb")
        processes.append(
            subprocess.Popen([executable, "run", "--config", str(config)], stdout=log, stderr=log)
        )
    try:
        yield ports
    finally:
        for process in processes:
            stop(process)


@pytest.fixture
def prometheus(tmp_path: Path, drains: list[int]) -> Iterator[str]:
    """A private Prometheus scraping the drains every second, with the alert rules loaded."""
    binary = prometheus_binary()
    port = faultload.free_port()
    config = tmp_path / "prometheus.yml"
    targets = ", ".join(f'"127.0.0.1:{p}"' for p in drains)
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f'rule_files: ["{promql.RULES}"]\n'
        "scrape_configs:\n"
        f"  - job_name: drain\n    static_configs:\n      - targets: [{targets}]\n"
    )
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until("Prometheus to be ready", lambda: _ready(url), DEADLINE_S, interval_s=0.5)
        yield url
    finally:
        stop(process)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def api(url: str, path: str, **params: str) -> Any:
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{query}", timeout=30) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def instant(url: str, expr: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = api(url, "query", query=expr)["result"]
    return result


def scalar(url: str, expr: str) -> float | None:
    result = instant(url, expr)
    return float(result[0]["value"][1]) if result else None


@pytest.mark.slow
def test_prometheus_sees_every_metric_the_dashboard_and_alerts_use(database: str, prometheus: str) -> None:
    with psycopg.connect(database) as conn:
        drain.stage_many(conn, [drain.Job("app.tasks.work", args=[n]) for n in range(GOOD_JOBS)])
        drain.stage_many(conn, [drain.Job("os.system", args=["true"]) for _ in range(BAD_JOBS)])
        drain.stage_many(conn, [drain.Job("app.tasks.later", delay=3600)])

    forwarded = 'sum(drain_jobs_total{outcome="published"})'
    wait_until(
        "the jobs to be forwarded",
        lambda: scalar(prometheus, forwarded) == GOOD_JOBS,
        DEADLINE_S,
        interval_s=0.5,
    )
    wait_until(
        "the dead letters",
        lambda: scalar(prometheus, "max(drain_dead_letter_jobs)") == BAD_JOBS,
        DEADLINE_S,
        interval_s=0.5,
    )
    assert scalar(prometheus, "sum(drain_leader)") == 1
    assert scalar(prometheus, "count(drain_due_jobs)") == 1  # the leader's only
    assert scalar(prometheus, "max(drain_scheduled_jobs)") == 1
    assert scalar(prometheus, 'sum(drain_jobs_total{outcome="rejected"})') == BAD_JOBS

    used: set[str] = set()
    for _, expr in promql.rule_expressions() + promql.dashboard_expressions():
        used |= promql.names_in(expr)[0]
    for name in sorted(used):
        wait_until(
            f"data for {name}", lambda name=name: bool(instant(prometheus, name)), DEADLINE_S, interval_s=0.5
        )

    for title, expr in promql.dashboard_expressions():
        query = promql.for_grafana(expr)
        wait_until(
            f"panel {title!r}: {query}",
            lambda query=query: bool(instant(prometheus, query)),
            DEADLINE_S,
            interval_s=0.5,
        )

    groups = api(prometheus, "rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert {rule["name"] for rule in rules} >= {name for name, _ in promql.rule_expressions()}
    wait_until(
        "every rule evaluated",
        lambda: all(r.get("lastEvaluation", "").startswith("2") for r in _rules(prometheus)),
        DEADLINE_S,
        interval_s=0.5,
    )
    assert all(rule["health"] == "ok" for rule in _rules(prometheus)), _rules(prometheus)
    firing = {alert["labels"]["alertname"] for alert in api(prometheus, "alerts")["alerts"]}
    assert firing <= {"DrainDeadLetters"}  # pending or firing: the three rejected jobs, nothing else


def _rules(url: str) -> list[dict[str, Any]]:
    return [rule for group in api(url, "rules")["groups"] for rule in group["rules"]]
