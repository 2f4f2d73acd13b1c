"""``drain run``: lead or stand by and forward jobs until a signal; ``--once``: what is due now."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Mapping

from drain import backend, config, errors
from drain.cli import database, serving, signals
from drain.cli.exit_codes import EXIT_FAILURE, EXIT_OK
from drain.cli.output import say as _say
from drain.observability import metrics
from drain.relay import failpoints, watchdog
from drain.relay import loop as relay


def cmd_run(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    if not settings.backends:
        raise errors.ConfigError("no backends configured: add a [backends.default] section")
    adapters = backend.build_adapters(settings.backends, settings.publish_timeout_s)
    drain_metrics = metrics.Metrics()
    if settings.metrics_listen and not args.once:
        serving.serve(drain_metrics, settings)
    guard = watchdog.Watchdog(settings.watchdog_bound_s(), env)
    relay_ = relay.Relay(
        settings,
        adapters,
        metrics_=drain_metrics,
        failpoints_=failpoints.Failpoints(env.get("DRAIN_FAILPOINTS", "")),
        watchdog=guard,
    )
    stop = threading.Event()
    guard.start()
    try:
        # from the first signal, the stop's deadline bounds the process (the watchdog backs it)
        with signals.handled(stop, settings.stop_timeout_s, on_stop=guard.stopping):
            if args.once:
                with database.closing(relay_.shutdown):
                    return _run_once(relay_, stop)
            relay_.run(stop)
    finally:
        guard.stop()
    return EXIT_OK


def _run_once(relay_: relay.Relay, stop: threading.Event) -> int:
    """Forward what is due now, a whole batch at a time; SIGTERM stops after the current batch."""
    total = relay_.drain_due(stop)
    if total is None:
        _say("another drain is leading this table; nothing done")
        return EXIT_FAILURE
    print(
        f"drain: published {total.published}, retried {total.retried}, rejected {total.rejected}, "
        f"dead-lettered {total.dead}"
    )
    if total.skipped:
        _say(f"{total.skipped} jobs left: a backend was unavailable")
        return EXIT_FAILURE
    return EXIT_OK
