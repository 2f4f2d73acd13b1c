"""The metrics endpoint of ``drain run`` wired to its settings and its database.

drain.observability.server serves; it knows neither the configuration nor the store: this module
gives it the address, the staleness bound (Settings.stale_after_s) and the readiness probe.
"""

from __future__ import annotations

import logging

import psycopg

from drain import config
from drain.observability import metrics, server
from drain.store import session as store

log = logging.getLogger(__name__)

PROBE_CONNECT_TIMEOUT_S = 2


def database_probe(settings: config.Settings) -> server.Probe:
    """A readiness probe: a fresh connection with the drain's parameters runs SELECT 1."""

    def probe() -> str | None:
        kwargs = store.connection_kwargs(settings)
        kwargs["connect_timeout"] = PROBE_CONNECT_TIMEOUT_S
        try:
            with psycopg.connect(settings.dsn, autocommit=True, **kwargs) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error as exc:
            log.debug("readiness probe failed: %s", type(exc).__name__)
            return "database unreachable"
        return None

    return probe


def serve(metrics_: metrics.Metrics, settings: config.Settings) -> server.MetricsServer:
    """Start the endpoint on ``settings.metrics_listen`` ("host:port") for ``drain run``.

    Raises DrainError with one line when the address cannot be bound.
    """
    listen = settings.metrics_listen or f"{config.DEFAULT_METRICS_HOST}:0"
    return server.serve(
        metrics_,
        listen,
        default_host=config.DEFAULT_METRICS_HOST,
        ready=database_probe(settings),
        stale_after_s=settings.stale_after_s(),
    )
