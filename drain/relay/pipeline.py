"""The batches a pipelined backend (RabbitMQ) has been handed and has not confirmed yet.

A full batch's share for a pipelined backend is only *submitted*; its confirms are *collected* by
a later step, after that step submitted its own, so the broker persists one batch while the
relay reads the next. This module only keeps the books, oldest first:

- at most ``depth`` batches stay in flight after a full batch; a partial batch collects them all;
- a batch older than ``max_age_s`` is collected by the next step whatever the depth (other
  backends can keep batches full for ever: its rows must not wait that long to be deleted);
- the rows in flight are excluded from the next selects by id;
- a backend that failed drops its batches: their rows were not deleted and go again.

The relay takes the books out of a step (``Stepper.step``) and puts them back only when that
step's transaction committed, so a failed step forgets everything it had in flight.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Iterator

from drain import models

MAX_AGE_S = 1.0


@dataclasses.dataclass
class Flight:
    """One backend's share of one batch, submitted and not yet collected."""

    backend: str
    jobs: list[models.StagedJob]
    ticket: object
    submitted_at: float


class InFlight:
    """Groups of flights (one group per step that submitted), oldest first."""

    def __init__(self, *, clock: Callable[[], float], max_age_s: float = MAX_AGE_S) -> None:
        self._groups: collections.deque[list[Flight]] = collections.deque()
        self._clock = clock
        self.max_age_s = max_age_s

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __iter__(self) -> Iterator[Flight]:
        return (flight for group in self._groups for flight in group)

    @property
    def jobs(self) -> int:
        return sum(len(flight.jobs) for flight in self)

    @property
    def memory_bytes(self) -> int:
        """What the jobs in flight weigh (drain.store.reading): it counts against batch_max_bytes."""
        return sum(job.memory_bytes for flight in self for job in flight.jobs)

    def row_ids(self) -> list[int]:
        return [job.id for flight in self for job in flight.jobs]

    def add(self, flights: Iterable[Flight]) -> None:
        group = list(flights)
        if group:
            self._groups.append(group)

    def due(self, *, keep: int) -> list[Flight]:
        """Remove and return the flights to collect now: all but the newest ``keep`` groups, and
        any group older than ``max_age_s``."""
        now = self._clock()
        taken: list[Flight] = []
        while self._groups and (
            len(self._groups) > keep or now - self._groups[0][0].submitted_at > self.max_age_s
        ):
            taken.extend(self._groups.popleft())
        return taken

    def drop(self, backends: set[str]) -> None:
        """Forget the flights of these backends (they failed: their rows go again)."""
        if not backends:
            return
        kept = ([flight for flight in group if flight.backend not in backends] for group in self._groups)
        self._groups = collections.deque(group for group in kept if group)

    def clear(self) -> None:
        self._groups.clear()
