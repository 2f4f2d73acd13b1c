"""G1: the network path from the drain to Postgres or to Redis is cut (FIN), reset (RST) or
blackholed (stalled, sockets kept open) for a few seconds through a TCP proxy, then healed; the
drain recovers and nothing committed is lost. The recovery time (heal → first committed delete)
is printed. The load generator talks to Postgres directly, so staging never stops."""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import PG_HOST, PG_PORT
from tests.support import configs, faultload, processes, proxy

FAULT_S = 3.0


@pytest.fixture
def path_proxy(request: pytest.FixtureRequest, redis_db: str) -> Iterator[proxy.Proxy]:
    target = request.param
    if target == "postgres":
        fault = proxy.Proxy(PG_HOST, PG_PORT)
    else:
        parts = urllib.parse.urlsplit(redis_db)
        fault = proxy.Proxy(parts.hostname or "127.0.0.1", parts.port or 6379)
    try:
        yield fault
    finally:
        fault.close()


def _through(url: str, port: int) -> str:
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [proxy.CUT, proxy.RESET, proxy.BLACKHOLE])
@pytest.mark.parametrize("path_proxy", ["postgres", "redis"], indirect=True)
def test_network_fault_then_heal(
    mode: str, path_proxy: proxy.Proxy, database: str, redis_db: str, tmp_path: Path
) -> None:
    faultload.prepare(database)
    to_postgres = path_proxy.target[1] == PG_PORT
    dsn = _through(database, path_proxy.port) if to_postgres else database
    broker = redis_db if to_postgres else _through(redis_db, path_proxy.port)
    config = configs.write_config(
        tmp_path / "drain.toml", dsn, {"default": configs.rq(broker)}, batch_size=50, publish_timeout_s=2.0
    )
    drain = processes.start_drain(config, None, tmp_path / "drain.log")
    load = faultload.load(database)

    def outage() -> float:
        path_proxy.set(mode)
        time.sleep(FAULT_S)  # the outage itself
        path_proxy.set(proxy.PASS)
        return time.time()

    recovery = faultload.fault_under_load(database, drain, load, outage)
    result = faultload.tally(database, redis_db, load)
    target = "postgres" if to_postgres else "redis"
    faultload.report(
        f"network {mode} to {target} for {FAULT_S:.0f}s",
        result,
        recovery_s=f"{recovery:.2f}",
        proxy_connections=path_proxy.connections,
    )
    result.check()
