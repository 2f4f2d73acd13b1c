"""The drain's HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz``, on a daemon thread.

- ``/metrics``: the process's registry in the Prometheus text format (``generate_latest``).
- ``/healthz`` (liveness): 200 while the relay loop keeps ticking; 503 once the last tick is
  older than ``stale_after_s`` (a wedged loop: restart the process).
- ``/readyz`` (readiness): 200 while the readiness probe it is given answers None; ``drain run``
  gives it one where the database answers ``ping`` on a fresh, short connection
  (drain.store.connection.database_probe). A standby is ready too: readiness never depends on
  leading. The probe's answer is cached for ``READY_CACHE_S`` so scrapes and probes never hammer
  the database.

The bodies say ``ok`` or why not, never a pid, a host or a DSN: the port may be reachable by
more than the monitoring system. It binds the address it is given (``drain run``: the configured
one, default 127.0.0.1). It knows neither the configuration nor the store: the CLI wires it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from http import server as http_server
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from drain import errors
from drain.config.settings import STALE_AFTER_MIN_S
from drain.observability import metrics

log = logging.getLogger(__name__)

STALE_AFTER_S = STALE_AFTER_MIN_S
"""The staleness bound of a server given none; ``drain run`` gives Settings.stale_after_s()."""
READY_CACHE_S = 2.0

Probe = Callable[[], str | None]
"""Returns None when ready, else a short reason."""


class _CachedProbe:
    def __init__(self, probe: Probe, ttl_s: float) -> None:
        self._probe = probe
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._answer: str | None = None
        self._at = float("-inf")

    def __call__(self) -> str | None:
        with self._lock:  # one probe at a time; the others wait for its answer
            now = time.monotonic()
            if now - self._at >= self._ttl_s:
                try:
                    self._answer = self._probe()
                except Exception as exc:  # noqa: BLE001 - a broken probe means not ready
                    self._answer = f"probe failed: {type(exc).__name__}"
                self._at = time.monotonic()
            return self._answer


class MetricsServer:
    """Serves one Metrics object; ``start()`` binds and returns, ``stop()`` closes. Port 0 picks one."""

    def __init__(
        self,
        metrics_: metrics.Metrics,
        host: str,
        port: int,
        *,
        ready: Probe,
        stale_after_s: float = STALE_AFTER_S,
        ready_cache_s: float = READY_CACHE_S,
    ) -> None:
        self.metrics = metrics_
        self.stale_after_s = stale_after_s
        self.ready = _CachedProbe(ready, ready_cache_s)
        host = host.strip("[]")
        server_class = _Server6 if ":" in host else _Server
        self._httpd: _Server = server_class((host, port), _Handler)
        self._httpd.owner = self
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="drain-metrics", daemon=True)
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", *self.address)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket. Idempotent."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        with contextlib.suppress(OSError):
            self._httpd.server_close()

    def health(self) -> tuple[int, str]:
        age = self.metrics.seconds_since_tick()
        if age > self.stale_after_s:
            return 503, f"stalled: the relay loop has not gone round for {age:.0f}s\n"
        return 200, "ok\n"

    def readiness(self) -> tuple[int, str]:
        reason = self.ready()
        return (200, "ok\n") if reason is None else (503, f"not ready: {reason}\n")


class _Server(http_server.ThreadingHTTPServer):
    daemon_threads = True
    owner: MetricsServer


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(http_server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, generate_latest(owner.metrics.registry), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            status, text = owner.health()
            self._send(status, text.encode())
        elif path == "/readyz":
            status, text = owner.readiness()
            self._send(status, text.encode())
        else:
            self._send(404, b"not found: /metrics, /healthz, /readyz\n")

    def _send(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def serve(
    metrics_: metrics.Metrics,
    listen: str,
    *,
    default_host: str,
    ready: Probe,
    stale_after_s: float = STALE_AFTER_S,
) -> MetricsServer:
    """Start the endpoint on ``listen`` ("host:port"; no host: ``default_host``) and return it.

    Raises DrainError with one line when the address cannot be bound.
    """
    host, _, port = listen.rpartition(":")
    try:
        server = MetricsServer(
            metrics_, host or default_host, int(port), ready=ready, stale_after_s=stale_after_s
        )
    except OSError as exc:
        raise errors.DrainError(f"cannot serve metrics on {listen}: {exc.strerror or exc}") from None
    return server.start()
