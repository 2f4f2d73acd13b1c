"""/metrics, /healthz and /readyz of a leader, a standby, and a drain whose database went away."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import psycopg
import pytest

import drain
from drain import cli, config, testing
from drain.observability import metrics
from drain.observability import server as metrics_server
from drain.relay import loop as relay
from tests import conftest
from tests.support.waiting import wait_until

DEADLINE_S = 90.0


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


@dataclasses.dataclass
class Drain:
    relay: relay.Relay
    metrics: metrics.Metrics
    server: metrics_server.MetricsServer
    stop: threading.Event
    thread: threading.Thread

    def url(self, path: str) -> str:
        host, port = self.server.address
        return f"http://{host}:{port}{path}"

    def scrape(self) -> str:
        status, text = get(self.url("/metrics"))
        assert status == 200
        return text

    def stop_relay(self) -> None:
        self.stop.set()
        self.thread.join(timeout=DEADLINE_S)

    def close(self) -> None:
        self.stop_relay()
        self.server.stop()


@contextlib.contextmanager
def running(settings: config.Settings) -> Iterator[Drain]:
    settings = dataclasses.replace(
        settings, backends={"default": config.BackendSettings("default", "memory", 3, {})}
    )
    metrics_ = metrics.Metrics()
    relay_ = relay.Relay(settings, {"default": testing.MemoryAdapter("default")}, metrics_=metrics_)
    relay_.figures_refresh_s = 0.1
    server = metrics_server.MetricsServer(
        metrics_, "127.0.0.1", 0, ready=metrics_server.database_probe(settings), ready_cache_s=0.1
    ).start()
    stop = threading.Event()
    thread = threading.Thread(target=relay_.run, args=(stop,), daemon=True)
    thread.start()
    the_drain = Drain(relay_, metrics_, server, stop, thread)
    try:
        yield the_drain
    finally:
        the_drain.close()


def test_leader_and_standby_are_both_ready_and_only_the_leader_exports_table_figures(
    settings: config.Settings, database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with psycopg.connect(database) as conn:
        drain.stage_many(conn, [drain.Job("app.later", delay=3600) for _ in range(7)])
    with running(settings) as first:
        wait_until("a leader", lambda: sample(first.scrape(), "drain_leader") == 1, DEADLINE_S)
        with running(settings) as second:
            wait_until(
                "the standby's loop",
                lambda: (sample(second.scrape(), "drain_loop_last_tick_timestamp_seconds") or 0) > 0,
                DEADLINE_S,
            )
            for one in (first, second):
                assert get(one.url("/healthz")) == (200, "ok\n")
                assert get(one.url("/readyz")) == (200, "ok\n")
            wait_until(
                "the leader's gauges", lambda: sample(first.scrape(), "drain_scheduled_jobs") == 7, DEADLINE_S
            )
            leader_text, standby_text = first.scrape(), second.scrape()
            assert sample(leader_text, "drain_due_jobs") == 0
            assert sample(leader_text, "drain_dead_letter_jobs") == 0
            assert sample(standby_text, "drain_leader") == 0
            for name in ("drain_due_jobs", "drain_scheduled_jobs", "drain_oldest_due_age_seconds"):
                assert sample(standby_text, name) is None, name
            assert 'drain_build_info{version="' + drain.__version__ + '"} 1.0' in standby_text

            # `drain status` reads the same definitions
            assert cli.main(["status", "--json", "--dsn", database]) == 0
            status = json.loads(capsys.readouterr().out)
            assert (status["future"], status["due"], status["dead"]) == (7, 0, 0)

            first.stop_relay()  # the standby takes over and starts exporting the figures
            wait_until(
                "the takeover", lambda: sample(second.scrape(), "drain_scheduled_jobs") == 7, DEADLINE_S
            )
            assert sample(second.scrape(), "drain_leader_changes_total") == 1
            assert sample(first.scrape(), "drain_leader") == 0
            assert sample(first.scrape(), "drain_scheduled_jobs") is None


def test_a_drain_whose_database_went_away_is_alive_but_not_ready(
    settings: config.Settings, database: str
) -> None:
    with running(settings) as one:
        wait_until("the leader's gauges", lambda: sample(one.scrape(), "drain_due_jobs") == 0, DEADLINE_S)
        assert get(one.url("/readyz"))[0] == 200
        with psycopg.connect(conftest.admin_dsn(), autocommit=True) as admin:
            name = psycopg.conninfo.conninfo_to_dict(database)["dbname"]
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        wait_until(
            "not ready",
            lambda: get(one.url("/readyz")) == (503, "not ready: database unreachable\n"),
            DEADLINE_S,
        )
        wait_until("leadership lost", lambda: sample(one.scrape(), "drain_leader") == 0, DEADLINE_S)
        assert sample(one.scrape(), "drain_due_jobs") is None
        ticks = one.metrics.seconds_since_tick
        wait_until("the loop to go round", lambda: ticks() < 1, DEADLINE_S)
        assert get(one.url("/healthz")) == (200, "ok\n")


def test_a_drain_that_cannot_reach_its_database_is_not_ready(settings: config.Settings) -> None:
    with socket.socket() as placeholder:  # a port nobody listens on
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    closed = dataclasses.replace(settings, dsn=f"postgresql://postgres@127.0.0.1:{port}/nothing")
    with running(closed) as one:
        assert get(one.url("/readyz")) == (503, "not ready: database unreachable\n")
        assert get(one.url("/healthz")) == (200, "ok\n")
        assert sample(one.scrape(), "drain_leader") == 0


def test_healthz_fails_when_the_loop_stops_ticking() -> None:
    now = [1000.0]
    metrics_ = metrics.Metrics(clock=lambda: now[0])
    server = metrics_server.MetricsServer(
        metrics_, "127.0.0.1", 0, ready=lambda: None, stale_after_s=30
    ).start()
    try:
        host, port = server.address
        assert get(f"http://{host}:{port}/healthz") == (200, "ok\n")
        now[0] += 31
        status, body = get(f"http://{host}:{port}/healthz")
        assert status == 503
        assert "stalled" in body
        metrics_.tick()
        assert get(f"http://{host}:{port}/healthz") == (200, "ok\n")
        assert get(f"http://{host}:{port}/nope")[0] == 404
    finally:
        server.stop()


def test_readiness_is_cached() -> None:
    calls: list[float] = []

    def probe() -> str | None:
        calls.append(time.monotonic())
        return None

    server = metrics_server.MetricsServer(metrics.Metrics(), "127.0.0.1", 0, ready=probe, ready_cache_s=3600)
    try:
        for _ in range(5):
            assert server.readiness() == (200, "ok\n")
        assert len(calls) == 1
    finally:
        server.stop()


def test_serve_binds_the_configured_address_and_reports_a_busy_port(settings: config.Settings) -> None:
    metrics_ = metrics.Metrics()
    server = metrics_server.serve(metrics_, dataclasses.replace(settings, metrics_listen="127.0.0.1:0"))
    try:
        host, port = server.address
        assert host == "127.0.0.1"
        busy = dataclasses.replace(settings, metrics_listen=f"127.0.0.1:{port}")
        with pytest.raises(drain.DrainError, match=r"cannot serve metrics on 127\.0\.0\.1:"):
            metrics_server.serve(metrics_, busy)
    finally:
        server.stop()


def test_the_default_listen_host_is_loopback() -> None:
    settings = config.load(None, env={"DRAIN_METRICS_LISTEN": ":9464"}, overrides={})
    assert settings.metrics_listen == "127.0.0.1:9464"
