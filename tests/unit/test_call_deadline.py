"""drain.backend.deadline: one deadline over a whole backend call, open and the call after it sharing one."""

from __future__ import annotations

import time

from drain.backend import deadline as call_deadline


def test_each_wait_gets_the_smaller_of_its_own_timeout_and_what_is_left() -> None:
    deadline = call_deadline.Deadline(10.0)
    deadline.start()
    assert deadline.bound(1.0) == 1.0
    left = deadline.bound(None)
    assert left is not None and 9.0 < left <= 10.0
    deadline.until(time.monotonic() + 0.5)
    wait = deadline.bound(5.0)
    assert wait is not None and wait <= 0.5


def test_past_the_deadline_no_wait_is_given_and_a_read_only_looks_at_what_arrived() -> None:
    deadline = call_deadline.Deadline(10.0)
    deadline.until(time.monotonic() - 1.0)
    assert deadline.bound(5.0) is None
    assert deadline.read_bound(5.0) == call_deadline.LAST_LOOK_S
    assert deadline.read_bound(None) == call_deadline.LAST_LOOK_S
    assert deadline.read_bound(0.0) == 0.0


def test_the_call_after_open_keeps_opens_deadline_and_the_next_one_starts_its_own() -> None:
    deadline = call_deadline.Deadline(10.0)
    deadline.until(time.monotonic() - 1.0)
    opened = deadline.opening()
    assert deadline.start() == opened  # open and the batch it was made for: one deadline
    deadline.until(opened - 5.0)  # that call ran out
    assert deadline.start() >= opened  # the next call has a deadline of its own
    assert deadline.bound(1.0) == 1.0


def test_an_open_whose_deadline_passed_does_not_fail_the_call_after_it() -> None:
    deadline = call_deadline.Deadline(10.0)
    opened = deadline.opening()
    deadline.at = opened - 20.0  # open ended at its deadline (or long ago: no call followed it)
    assert deadline.start() > time.monotonic() + 9.0
