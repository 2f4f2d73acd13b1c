"""drain.observability.logs.RepeatFilter: one line per cause per interval, with a count (issue 33:
a revoked write permission made pika write about 100 warnings a second)."""

from __future__ import annotations

import io
import logging

import hypothesis
from hypothesis import strategies as st

from drain.observability import logs


def logger_with(clock: list[float], interval_s: float = 10.0) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logs.handler("text", out, interval_s)
    for installed in handler.filters:
        if isinstance(installed, logs.RepeatFilter):
            installed._clock = lambda: clock[0]
    logger = logging.getLogger(f"tests.repeat.{id(out)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, out


def test_a_flood_of_one_cause_is_one_line_per_interval_with_the_count() -> None:
    clock = [0.0]
    logger, out = logger_with(clock)
    for n in range(888):  # 8 s at about 110 a second, each naming another channel, as pika does
        clock[0] = n * 0.009
        logger.warning("Received remote Channel.Close (403): %r on channel %d", "ACCESS_REFUSED", n)
    clock[0] = 10.5
    logger.warning("Received remote Channel.Close (403): %r on channel %d", "ACCESS_REFUSED", 999)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert "channel 0" in lines[0]
    assert "channel 999" in lines[1] and "(887 more like this in the last 10s)" in lines[1]


def test_other_causes_and_info_lines_pass() -> None:
    clock = [0.0]
    logger, out = logger_with(clock)
    for backend in ("a", "b", "a", "b"):
        logger.warning("backend %s unavailable", backend, extra={"backend": backend})
    logger.warning("backend %s unavailable", "a", extra={"backend": "a", "reason": "another"})
    for _ in range(3):
        logger.info("backend available again")
    assert len(out.getvalue().splitlines()) == 3 + 3


def test_zero_writes_every_line() -> None:
    clock = [0.0]
    logger, out = logger_with(clock, interval_s=0)
    for _ in range(5):
        logger.warning("the same")
    assert len(out.getvalue().splitlines()) == 5


@hypothesis.given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 5)), max_size=60))
def test_each_cause_is_written_at_most_once_per_interval(events: list[tuple[str, float]]) -> None:
    clock = [0.0]
    logger, out = logger_with(clock)
    for cause, step in events:
        clock[0] += step
        logger.warning("cause %s", cause, extra={"reason": cause})
    written: dict[str, list[float]] = {}
    for line in out.getvalue().splitlines():
        cause = line.split("cause ")[1][0]
        written.setdefault(cause, []).append(0.0)
    distinct = {cause for cause, _ in events}
    assert set(written) == distinct
    total_s = sum(step for _, step in events)
    for cause in distinct:
        assert len(written[cause]) <= 1 + total_s / 10.0
