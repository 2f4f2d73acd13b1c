"""Which backends are open, which are paused and until when, and which queues refuse their jobs.

A backend found unavailable is closed and paused (backoff 0.5 s doubling to 30 s, jittered) once
per step however many of its calls fail; one that answers is up again (drain_backend_up 1). A
queue whose jobs all came back RETRY (nacked) gives them a longer wait each time (1-2 s doubling
to 30 s, jittered), until one of that queue's jobs is published: a full queue (max-length with
reject-publish) is held back without holding back the other queues. drain.relay.dispatch makes
the calls; this module keeps their consequences.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence

from drain import errors, models
from drain.backend import Adapter
from drain.observability import metrics
from drain.relay import backoff

log = logging.getLogger(__name__)

PAUSE_MIN_S = 0.5
PAUSE_MAX_S = 30.0
NACKED_MIN_S = 2.0  # times the jitter factor [0.5, 1): settlement's usual 1-2 s for a nack
NACKED_MAX_S = 30.0
MAX_NACKED_QUEUES = 10_000  # queues with a streak of refusals remembered at once

Results = dict[int, models.PublishResult]


@dataclasses.dataclass
class _Pause:
    until: float
    streak: backoff.Streak


class Availability:
    """The open and paused backends; use from one thread."""

    def __init__(
        self,
        adapters: Mapping[str, Adapter],
        *,
        metrics_: metrics.Metrics,
        clock: Callable[[], float],
        rand: Callable[[], float],
    ) -> None:
        self.adapters = adapters
        self.failed: set[str] = set()
        """Backends found unavailable since the step began."""
        self._metrics = metrics_
        self._clock = clock
        self._backoff = backoff.Backoff(PAUSE_MIN_S, PAUSE_MAX_S, rand)
        self._open: set[str] = set()
        self._pauses: dict[str, _Pause] = {}

    def pause_streak(self, name: str) -> int:
        """How many times in a row ``name`` was found unavailable (0: it is not paused)."""
        pause = self._pauses.get(name)
        return 0 if pause is None else pause.streak.count

    def paused(self) -> list[str]:
        now = self._clock()
        return [name for name, pause in self._pauses.items() if pause.until > now]

    def ensure_open(self, name: str) -> None:
        """Open the backend unless open; a backend that cannot open is unavailable (raises)."""
        if name in self._open:
            return
        try:
            self.adapters[name].open()
        except errors.BackendUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - a backend that cannot open is unavailable
            raise errors.BackendUnavailable(
                f"{name}: cannot open: {type(exc).__name__}: {errors.first_line(exc)}"
            ) from None
        self._open.add(name)

    def fail(self, name: str, exc: errors.BackendUnavailable) -> None:
        """Pause a backend found unavailable, once per step however many of its calls fail."""
        if name in self.failed:
            return
        self.failed.add(name)
        pause = self._pauses.get(name) or _Pause(0.0, backoff.Streak(self._backoff))
        delay = pause.streak.next()
        pause.until = self._clock() + delay
        self._pauses[name] = pause
        self.close(name)
        self._metrics.set_backend_up(name, False)
        reason = errors.first_line(exc)
        log.warning(
            "backend %s unavailable, retrying in %.1fs: %s",
            name,
            delay,
            reason,
            extra={
                "event": "backend_unavailable",
                "backend": name,
                "retry_in_s": round(delay, 3),
                "attempts": pause.streak.count,
                "reason": reason,
            },
        )

    def resume(self, name: str) -> None:
        """The backend answered: up again."""
        if self._pauses.pop(name, None) is not None:
            log.info(
                "backend %s is available again", name, extra={"event": "backend_available", "backend": name}
            )
        self._metrics.set_backend_up(name, True)

    def answers_ping(self, name: str) -> bool:
        """Whether the backend answers a ping; if not, it is unavailable (paused)."""
        try:
            self.ensure_open(name)
            self.adapters[name].ping()
        except Exception as exc:  # noqa: BLE001 - any failure to answer a ping is an outage
            unavailable = (
                exc
                if isinstance(exc, errors.BackendUnavailable)
                else errors.BackendUnavailable(f"{name}: {type(exc).__name__}: {errors.first_line(exc)}")
            )
            self.fail(name, unavailable)
            return False
        return True

    def close(self, name: str) -> None:
        if name in self._open:
            self._open.discard(name)
            try:
                self.adapters[name].close()
            except Exception as exc:  # noqa: BLE001 - closing a broken connection may fail
                reason = type(exc).__name__
                log.debug(
                    "closing backend %s failed: %s", name, reason, extra={"backend": name, "reason": reason}
                )

    def close_all(self) -> None:
        for name in list(self._open):
            self.close(name)


class NackedQueues:
    """The queues none of whose jobs were published in their backend's last calls."""

    def __init__(self, rand: Callable[[], float]) -> None:
        self._backoff = backoff.Backoff(NACKED_MIN_S, NACKED_MAX_S, rand)
        self._streaks: dict[tuple[str, str], backoff.Streak] = {}
        """(backend, queue) -> its streak of calls in which every job came back RETRY."""

    def pace(self, jobs: Sequence[models.StagedJob], results: Results) -> Results:
        """Give the RETRY results of a queue none of whose jobs in this call was published a
        longer wait each time (a streak per backend and queue); a publish ends the streak."""
        by_queue: dict[tuple[str, str], list[models.PublishResult]] = collections.defaultdict(list)
        for job in jobs:
            if (result := results.get(job.id)) is not None:
                by_queue[job.backend, job.queue].append(result)
        for key, answered in by_queue.items():
            if any(result.outcome is models.Outcome.PUBLISHED for result in answered):
                self._streaks.pop(key, None)
                continue
            retried = [result for result in answered if result.outcome is models.Outcome.RETRY]
            if not retried:
                continue
            if key not in self._streaks and len(self._streaks) >= MAX_NACKED_QUEUES:
                self._streaks.clear()  # forgetting streaks only shortens waits back to the usual
            streak = self._streaks.setdefault(key, backoff.Streak(self._backoff))
            streak.count += 1
            for result in retried:
                delay = self._backoff.delay(streak.count)
                results[result.row_id] = dataclasses.replace(result, retry_after_s=delay)
        return results
