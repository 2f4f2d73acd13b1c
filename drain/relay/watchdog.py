"""The watchdog: a drain whose loop stops making progress gives up the lead by exiting.

Why
---
A leader stuck *between* batches (a hung DNS lookup, a broker client that never returns, a bug
holding the GIL) keeps its session, and the lock, for ever. The server's idle-in-transaction
timeout covers only a hang inside a transaction.

How
---
- The relay pets the watchdog (``pet()``) each time its loop goes round.
- Without a pet within the bound, the process dumps every thread's stack to stderr and exits 1
  (``faulthandler``: its timer is a C thread that needs no GIL).
- The exit closes the session, freeing the lock for a standby; the supervisor restarts it.
- Idle is not stuck: the loop pets with the wait it is about to take, and the bound counts from
  its end. A turn that never ends is still ended ``bound_s`` after it began.
- Shortly before the dump (WARN_LEAD_S), a Python thread logs ``watchdog_expiring``, when it can.
  The dump itself is plain text whatever ``log_format`` says.

systemd
-------
With ``NOTIFY_SOCKET`` set (``Type=notify``) it speaks sd_notify: ``READY=1`` once running,
``WATCHDOG=1`` on each pet (at most once a second, for ``WatchdogSec=``), ``STOPPING=1`` on
shutdown.
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
STOP_GRACE_S = 2.0  # past the stop's deadline, the watchdog's exit if the deadline's could not run
WARN_LEAD_S = 1.0  # at most this long (and a quarter of the bound) before the dump, the record


class Watchdog:
    """Exit the process when ``pet()`` has not been called for ``bound_s`` seconds; tell systemd
    at the socket ``env`` names."""

    def __init__(
        self,
        bound_s: float,
        env: Mapping[str, str],
        *,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bound_s = bound_s
        address = env.get("NOTIFY_SOCKET", "")
        self._notify_at = "\0" + address[1:] if address.startswith("@") else address
        self._stream = stream or sys.stderr
        self._clock = clock
        self._armed_until = float("-inf")
        self._notified_at = float("-inf")
        self._stopped = threading.Event()

    def start(self) -> None:
        self._arm(self.bound_s)
        threading.Thread(target=self._warn_before_exit, name="drain-watchdog", daemon=True).start()
        self._notify(f"READY=1\nMAINPID={os.getpid()}")

    def pet(self, wait_s: float = 0.0) -> None:
        """The loop made progress and waits ``wait_s``: the process exits only if no pet comes
        within ``bound_s`` after that wait. Cheap: it re-arms only when the exit moves by
        REARM_EVERY_S or more. After ``stopping()`` or ``stop()``, nothing."""
        if self._stopped.is_set():
            return
        now = self._clock()
        if abs(now + wait_s + self.bound_s - self._armed_until) >= REARM_EVERY_S:
            self._arm(wait_s + self.bound_s)
        if now - self._notified_at >= REARM_EVERY_S:
            self._notified_at = now
            self._notify("WATCHDOG=1")

    def stopping(self, deadline_s: float) -> None:
        """The process must be gone within ``deadline_s`` (drain.cli.signals ends it then). Pets
        do nothing from now on; the dump and exit come STOP_GRACE_S after the deadline, for a
        stop stuck where no Python thread runs."""
        self._stopped.set()
        self._arm(deadline_s + STOP_GRACE_S)
        self._notify("STOPPING=1")

    def stop(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self._stopped.set()
        self._notify("STOPPING=1")

    def _notify(self, state: str) -> None:
        """sd_notify; nothing without a socket."""
        if not self._notify_at:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(state.encode(), self._notify_at)
        except OSError as exc:
            log.debug("sd_notify %s failed: %s", state, exc)

    def _arm(self, timeout_s: float) -> None:
        self._armed_until = self._clock() + timeout_s
        with contextlib.suppress(ValueError, OSError):  # a stream without a file descriptor
            faulthandler.dump_traceback_later(timeout_s, exit=True, file=self._stream)

    def _warn_before_exit(self) -> None:
        """Log once per armed period that ends without a pet, WARN_LEAD_S before faulthandler
        exits (only the timer and this thread read ``_armed_until``; a stale read costs one wait)."""
        lead_s = min(WARN_LEAD_S, self.bound_s / 4)
        warned_for = None
        while not self._stopped.is_set():
            armed_until = self._armed_until
            remaining = armed_until - lead_s - self._clock()
            if remaining > 0:
                self._stopped.wait(min(remaining, REARM_EVERY_S))
                continue
            if warned_for != armed_until:
                warned_for = armed_until
                log.critical(
                    "watchdog: the loop made no progress for %.1fs; unless it moves within %.1fs the "
                    "process exits with every thread's stack on stderr (plain text)",
                    self.bound_s - lead_s,
                    lead_s,
                    extra={"event": "watchdog_expiring", "bound_s": self.bound_s},
                )
            self._stopped.wait(lead_s / 4)
