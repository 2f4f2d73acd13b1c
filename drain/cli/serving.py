"""The metrics endpoint of ``drain run`` wired to its settings and its database.

drain.observability.server serves; it knows neither the configuration nor the store: this module
gives it the address, the staleness bound (Settings.stale_after_s) and the readiness probe.
"""

from __future__ import annotations

from drain import config
from drain.observability import metrics, server
from drain.store import connection


def serve(metrics_: metrics.Metrics, settings: config.Settings) -> server.MetricsServer:
    """Start the endpoint on ``settings.metrics_listen`` ("host:port") for ``drain run``.

    Raises DrainError with one line when the address cannot be bound.
    """
    listen = settings.metrics_listen or f"{config.DEFAULT_METRICS_HOST}:0"
    return server.serve(
        metrics_,
        listen,
        default_host=config.DEFAULT_METRICS_HOST,
        ready=connection.database_probe(settings),
        stale_after_s=settings.stale_after_s(),
    )
