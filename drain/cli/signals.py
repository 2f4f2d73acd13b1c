"""SIGTERM and SIGINT while a command runs: the only place drain installs signal handlers.

The first signal sets an Event (the relay finishes its batch, releases the lock, exits 0); the
second exits at once with EXIT_FORCED (the batch rolls back; nothing is lost).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from drain.cli import exit_codes, output
from drain.observability import logs

STOPPING = "stopping after the current batch (a second signal exits at once)"
STOPPING_LINE = f"drain: {STOPPING}\n".encode()  # with log_format text
FORCED = "second signal: exiting at once (the batch rolls back)"


@contextlib.contextmanager
def handled(stop: threading.Event) -> Iterator[None]:
    """First SIGTERM/SIGINT: finish the batch, release the lock, exit 0. Second: exit at once."""

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
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
