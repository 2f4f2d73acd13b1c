"""The test suite's one way to wait: poll a condition until a deadline, then fail saying what for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(what: str, condition: Callable[[], Any], timeout_s: float, interval_s: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something truthy and return that; at the deadline fail
    with ``what`` (what the test was waiting for)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def steps_until(
    step: Callable[[], Any], done: Callable[[Any], bool], what: str, max_steps: int = 1000
) -> None:
    """Call ``step`` until ``done(its result)``; fail with ``what`` after ``max_steps`` calls (a
    count, not a clock: for steps the test drives itself, e.g. one relay loop iteration each)."""
    for _ in range(max_steps):
        if done(step()):
            return
    raise AssertionError(f"{what}: not done after {max_steps} steps")
