"""An in-memory backend for unit tests of the relay loop, shipped so apps can test with it too.

``MemoryAdapter`` records every job it accepted. A test scripts its behaviour per job with
``behaviour`` (a callable from StagedJob to "ack", "retry", "reject", "down" or "raise" — an
unexpected exception, as a buggy adapter would raise) or for the whole backend with ``down = True``.
It is not a broker: integration tests use real ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from drain import errors, models
from drain.backend import options

Behaviour = Literal["ack", "retry", "reject", "down", "raise"]


class MemoryAdapter:
    """Keeps published jobs in ``self.published`` (a list, duplicates included)."""

    def __init__(self, name: str = "memory") -> None:
        self.name = name
        self.published: list[models.StagedJob] = []
        self.behaviour: Callable[[models.StagedJob], Behaviour] = lambda job: "ack"
        self.down = False
        self.ping_fails = False
        self.opened = 0
        self.closed = 0
        self.is_open = False

    @classmethod
    def from_options(
        cls, name: str, options_: Mapping[str, Any], *, publish_timeout_s: float
    ) -> MemoryAdapter:
        problems = options.OptionReader(options_, f"backends.{name}.").finish()
        if problems:
            raise errors.ConfigError(problems)
        return cls(name)

    def open(self) -> None:
        if self.down:
            raise errors.BackendUnavailable(f"backend {self.name} is down")
        self.opened += 1
        self.is_open = True

    def ping(self) -> None:
        if self.down or self.ping_fails:
            raise errors.BackendUnavailable(f"backend {self.name} is down")

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        if self.down:
            raise errors.BackendUnavailable(f"backend {self.name} is down")
        results = []
        for job in jobs:
            what = self.behaviour(job)
            if what == "down":
                raise errors.BackendUnavailable(f"backend {self.name} went down")
            if what == "raise":
                raise ValueError(f"memory: cannot encode job {job.id}")
            if what == "ack":
                self.published.append(_with_tick_meta(job))
                results.append(models.PublishResult.published(job))
            elif what == "retry":
                results.append(models.PublishResult.retry(job, "memory: nacked"))
            else:
                results.append(models.PublishResult.rejected(job, "memory: rejected"))
        return results

    def close(self) -> None:
        if self.is_open:
            self.closed += 1
        self.is_open = False


def _with_tick_meta(job: models.StagedJob) -> models.StagedJob:
    """A schedule's tick with its name and tick in its ``meta`` option, as RQ's job meta shows
    them (and as this adapter showed them before the tick travelled in StagedJob)."""
    meta = job.options.get("meta")
    if not models.tick_metadata(job) or not (meta is None or isinstance(meta, Mapping)):
        return job
    return dataclasses.replace(job, options={**job.options, "meta": models.with_tick(meta, job)})


class PipelinedMemoryAdapter(MemoryAdapter):
    """A MemoryAdapter with ``submit``/``collect``: the relay keeps its batches in flight.

    ``submit`` only records the batch (``submitted``); ``collect`` decides each job's outcome
    with ``behaviour`` at that moment, and raises BackendUnavailable if ``down`` by then.
    """

    def __init__(self, name: str = "memory") -> None:
        super().__init__(name)
        self.submitted: list[list[models.StagedJob]] = []
        self.outstanding = 0

    def submit(self, jobs: Sequence[models.StagedJob], /) -> list[models.StagedJob]:
        batch = list(jobs)
        self.submitted.append(batch)
        self.outstanding += 1
        return batch

    def collect(self, ticket: list[models.StagedJob], /) -> list[models.PublishResult]:
        self.outstanding -= 1
        return self.publish_batch(ticket)
