"""SIGTERM and SIGINT while a command runs: the only place drain installs signal handlers.

The first signal sets an Event (the relay finishes its batch, releases the lock, exits 0); the
second exits at once with EXIT_FORCED (the batch rolls back; nothing is lost).

The stop deadline
-----------------
- From the first signal, the whole stop (finish the step, settle what is in flight, release the
  lock, close) has one deadline, ``stop_timeout_s``.
- A thread of its own waits for it: past it, one line and ``os._exit(EXIT_STOP_DEADLINE)``,
  whatever socket the main thread waits on (a half-open link to the database or a broker).
- Nothing is lost: the transaction open then never committed, so its rows stay staged.
- ``drain run`` hands the watchdog over (``Watchdog.stopping``): it no longer counts turns, and
  ends the process shortly after the deadline should no Python thread run (the GIL held).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from drain.cli import exit_codes, output
from drain.observability import logs

STOPPING = "stopping after the current batch (a second signal exits at once)"
STOPPING_LINE = f"drain: {STOPPING}\n".encode()  # with log_format text
FORCED = "second signal: exiting at once (the batch rolls back)"
DEADLINE = (
    "the stop did not finish within stop_timeout_s ({:g}s) of the signal: exiting now "
    "(the open batch rolls back; its rows stay staged and go again)"
)


@contextlib.contextmanager
def handled(
    stop: threading.Event,
    deadline_s: float | None = None,
    on_stop: Callable[[float], object] = lambda deadline_s: None,
) -> Iterator[None]:
    """First SIGTERM/SIGINT: finish the batch, release the lock, exit 0. Second: exit at once.

    With ``deadline_s``: from the first signal (``stop`` set), ``on_stop(deadline_s)`` is called
    and the block has ``deadline_s`` to end; past it the process exits EXIT_STOP_DEADLINE at once.
    """

    def handle(signum: int, frame: FrameType | None) -> None:
        # os.write, not logging or sys.stderr: a handler that interrupts a write to either would
        # re-enter it. logs.render takes no lock.
        name = signal.Signals(signum).name
        if stop.is_set():
            line = logs.render(
                FORCED, output.stderr_format(), level=logging.WARNING, event="forced_exit", signal=name
            )
            os.write(2, line.encode())
            os._exit(exit_codes.EXIT_FORCED)
        stop.set()
        line = logs.render(
            STOPPING, output.stderr_format(), level=logging.INFO, event="stopping", signal=name
        )
        os.write(2, line.encode())

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    done = threading.Event()
    if deadline_s is not None:
        watcher = threading.Thread(
            target=_deadline, args=(stop, done, deadline_s, on_stop), name="drain-stop-deadline", daemon=True
        )
        watcher.start()
    try:
        yield
    finally:
        done.set()
        stop.set()  # ends the deadline's wait for a signal: the command is over
        for sig, old in previous.items():
            signal.signal(sig, old)


def _deadline(
    stop: threading.Event, done: threading.Event, deadline_s: float, on_stop: Callable[[float], object]
) -> None:
    """Wait for the first signal, then for the command to end; past ``deadline_s``, exit."""
    stop.wait()
    if done.is_set():
        return
    on_stop(deadline_s)
    if done.wait(deadline_s):
        return
    line = logs.render(
        DEADLINE.format(deadline_s),
        output.stderr_format(),
        level=logging.ERROR,
        event="stop_deadline",
        stop_timeout_s=deadline_s,
    )
    os.write(2, line.encode())
    os._exit(exit_codes.EXIT_STOP_DEADLINE)
