"""The watchdog: a drain whose loop stops making progress gives up the lead by exiting.

A leader stuck *between* batches — a hung DNS lookup, a broker client that never returns, a bug
that holds the GIL — keeps its session, and so the lock, for ever: the server's
idle-in-transaction timeout only covers a hang inside a transaction. So the relay ``pet()``\\s
the watchdog every time its loop goes round, and if no pet comes within the bound, the process
dumps every thread's stack to stderr and exits with status 1 (``faulthandler``, whose timer is a
C thread that needs no GIL). The exit closes the session, which frees the lock for a standby;
the supervisor (systemd, Kubernetes) restarts the process.

With systemd (``NOTIFY_SOCKET`` set, ``Type=notify``) it also speaks sd_notify: ``READY=1`` once
running, ``WATCHDOG=1`` on each pet (at most once a second) so ``WatchdogSec=`` works, and
``STOPPING=1`` on shutdown.

The stack dump is plain text whatever ``log_format`` says: it is written by faulthandler's C
thread, which must work when no Python code can run. Shortly before it (WARN_LEAD_S), a Python
thread logs one record (``event`` ``watchdog_expiring``, JSON in JSON mode) — when it can: a loop
stuck holding the GIL leaves only the dump.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TextIO

log = logging.getLogger(__name__)

EXIT_CODE = 1  # faulthandler's
REARM_EVERY_S = 1.0
WARN_LEAD_S = 1.0  # at most this long (and a quarter of the bound) before the dump, the record


class Notifier:
    """sd_notify over the datagram socket systemd names in ``NOTIFY_SOCKET``; a no-op without it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        address = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def send(self, state: str) -> None:
        if not self._address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(state.encode(), self._address)
        except OSError as exc:
            log.debug("sd_notify %s failed: %s", state, exc)


class Watchdog:
    """Exit the process when ``pet()`` has not been called for ``bound_s`` seconds."""

    def __init__(
        self,
        bound_s: float,
        notifier: Notifier,
        *,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bound_s = bound_s
        self._notifier = notifier
        self._stream = stream or sys.stderr
        self._clock = clock
        self._armed_at = float("-inf")
        self._notified_at = float("-inf")
        self._stopped = threading.Event()

    def start(self) -> None:
        self._arm()
        threading.Thread(target=self._warn_before_exit, name="drain-watchdog", daemon=True).start()
        self._notifier.send(f"READY=1\nMAINPID={os.getpid()}")

    def pet(self) -> None:
        """The loop made progress. Cheap: re-arms at most every REARM_EVERY_S."""
        now = self._clock()
        if now - self._armed_at >= REARM_EVERY_S:
            self._arm()
        if now - self._notified_at >= REARM_EVERY_S:
            self._notified_at = now
            self._notifier.send("WATCHDOG=1")

    def stop(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self._stopped.set()
        self._notifier.send("STOPPING=1")

    def _arm(self) -> None:
        self._armed_at = self._clock()
        with contextlib.suppress(ValueError, OSError):  # a stream without a file descriptor
            faulthandler.dump_traceback_later(self.bound_s, exit=True, file=self._stream)

    def _warn_before_exit(self) -> None:
        """Log once per armed period that ends without a pet, WARN_LEAD_S before faulthandler
        exits (only the timer and this thread read ``_armed_at``; a stale read costs one wait)."""
        lead_s = min(WARN_LEAD_S, self.bound_s / 4)
        warned_for = None
        while not self._stopped.is_set():
            armed_at = self._armed_at
            remaining = armed_at + self.bound_s - lead_s - self._clock()
            if remaining > 0:
                self._stopped.wait(min(remaining, REARM_EVERY_S))
                continue
            if warned_for != armed_at:
                warned_for = armed_at
                log.critical(
                    "watchdog: the loop made no progress for %.1fs; unless it moves within %.1fs the "
                    "process exits with every thread's stack on stderr (plain text)",
                    self.bound_s - lead_s,
                    lead_s,
                    extra={"event": "watchdog_expiring", "bound_s": self.bound_s},
                )
            self._stopped.wait(lead_s / 4)
