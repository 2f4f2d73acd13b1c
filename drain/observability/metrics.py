"""Prometheus metrics of one drain process, on a registry it owns.

The relay reports what happened through the methods below; nothing here touches the database
or a broker. Labels are bounded: backend, queue and outcome, never ids or arguments. A row names
its backend and queue, so those two label values are bounded here, whatever the rows say
(:class:`BoundedLabel`): ``backend`` is a configured backend's name, else ``OTHER``; ``queue`` is
a queue the configuration names (``[[schedules]]``) or one of the first ``MAX_QUEUE_LABELS``
other queue names this process saw, else ``OTHER``. 20,000 distinct queues in the rows make at
most ``MAX_QUEUE_LABELS + 1`` (plus the configured) series per backend and outcome.

The database-derived gauges (due and scheduled rows, the lag, dead letters) are exported by the
leader only: the relay refreshes them at most every ``REFRESH_S`` with capped, index-driven
queries (``Store.status``), and they disappear from the exposition when this process stops
leading, so ``max()`` over every drain of a table is the table's figure. ``docs/metrics.md``
lists every name; the dashboard and alert rules in ``grafana/`` and ``deploy/prometheus/`` are
tested against :meth:`Metrics.sample_names`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Info

from drain.observability import families
from drain.version import __version__

CANNOT_SETTLE_REASONS = families.CANNOT_SETTLE_REASONS
"""The ``reason`` label values of drain_cannot_settle: drain.relay.leadership.REASONS."""
REFRESH_S = 5.0
"""How often the leader refreshes the database-derived gauges, at most."""
COUNT_CAP = 100_000
"""Row counts behind the gauges stop at this many per index branch: a scrape never costs a full count."""
KEY_COUNT_CAP = 10_000
"""The blocked-key gauges look at this many due rows per index branch: each keyed row among them
costs a probe of the key index (about 3 pages), where a counted row costs a fraction of one."""
OTHER = "(other)"
"""The label value of every backend the configuration does not name, and of the queues past the bound."""
MAX_QUEUE_LABELS = 100
"""Queue label values taken from rows (first seen, first kept) beyond the configured queues."""
MAX_LABEL_CHARS = 100
"""A longer name (or one with a character that does not print) is counted under OTHER."""

log = logging.getLogger(__name__)

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "info": ("_info",),
    "gauge": ("",),
}


class BoundedLabel:
    """The label values a dimension may take: the known ones, then the first ``spare`` others
    seen (each printable and at most MAX_LABEL_CHARS long), then OTHER. Thread-safe."""

    def __init__(self, what: str, known: Iterable[str] = (), spare: int = 0) -> None:
        self._what = what
        self._lock = threading.Lock()
        self._values: set[str] = set()
        self._spare = spare
        self._overflowed = False
        self.know(known)

    def know(self, values: Iterable[str]) -> None:
        """Admit ``values`` (from the configuration) whatever the bound."""
        with self._lock:
            self._values.update(value for value in values if _labelable(value))

    def __call__(self, value: str) -> str:
        if value in self._values:
            return value
        with self._lock:
            if value in self._values:
                return value
            if self._spare > 0 and _labelable(value):
                self._spare -= 1
                self._values.add(value)
                return value
            first, self._overflowed = not self._overflowed, True
        if first:
            log.info(
                "metrics: a %s outside the label bound (not configured, past the first ones, too "
                "long or unprintable) is counted as %s from now on",
                self._what,
                OTHER,
                extra={"event": "metric_labels_overflow", "label": self._what},
            )
        return OTHER

    def __len__(self) -> int:
        return len(self._values)


def _labelable(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_LABEL_CHARS and value.isprintable()


class Metrics(families.Throughput, families.Loop, families.Settlement):
    """Every metric the drain exports; one instance per process. Thread-safe.

    ``backends`` and ``queues`` are the label values the configuration names (:meth:`know` adds
    more); any other backend is counted as OTHER, and other queues up to MAX_QUEUE_LABELS. The
    families and the methods that report to them live in drain.observability.families, by concern.
    """

    backend_label: BoundedLabel
    queue_label: BoundedLabel

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        backends: Iterable[str] = (),
        queues: Iterable[str] = (),
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.backend_label = BoundedLabel("backend", backends)
        self.queue_label = BoundedLabel("queue", queues, MAX_QUEUE_LABELS)
        self._figures = families.DatabaseFigures()
        self._register_throughput(self.registry)
        self._register_loop(self.registry, clock)
        self._register_settlement(self.registry)
        self.build = Info("drain_build", "The drain's version.", registry=self.registry)
        self.build.info({"version": __version__})
        self.registry.register(self._figures)

    def know(self, *, backends: Iterable[str] = (), queues: Iterable[str] = ()) -> None:
        """Label values the configuration names: the relay's backends, the schedules' queues."""
        self.backend_label.know(backends)
        self.queue_label.know(queues)

    def sample_names(self) -> set[str]:
        """Every sample name this registry can export, whether or not it has data yet."""
        names: set[str] = set()
        families_ = list(self.registry.collect()) + list(self._figures.describe())
        for family in families_:
            names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        return names
