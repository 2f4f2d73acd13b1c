"""One backoff for every wait that grows after a failure: capped exponential with jitter.

Attempt ``n`` (from 1) waits ``base_s · 2^(n−1)``, capped at ``max_s``, times a random factor in
[0.5, 1) ("equal jitter"): never above the cap, and drains that failed together do not come back
together.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

MAX_DOUBLINGS = 60  # 2**60 overflows no float and outgrows any cap


@dataclasses.dataclass
class Backoff:
    """How long attempt ``n`` waits; ``rand`` returns a number in [0, 1) (injectable for tests).

    Also a streak: consecutive failures (or idle polls) of one thing, ``count`` of them. Each
    ``next()`` waits longer, until ``reset()``. ``dataclasses.replace`` gives a fresh one.
    """

    base_s: float
    max_s: float
    rand: Callable[[], float] = random.random
    count: int = 0

    def delay(self, attempt: int) -> float:
        doublings = min(max(attempt, 1) - 1, MAX_DOUBLINGS)
        return min(self.base_s * 2.0**doublings, self.max_s) * (0.5 + self.rand() / 2)

    def next(self) -> float:
        self.count += 1
        return self.delay(self.count)

    def reset(self) -> None:
        self.count = 0
