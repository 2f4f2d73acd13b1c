"""Failpoints: named places in the relay where a test can make the process die, freeze or fail.

Armed from a spec string such as ``"after_select=exit,after_publish=stop@3"`` (the CLI reads it
from ``DRAIN_FAILPOINTS``). Actions: ``exit`` (``os._exit(137)``, like SIGKILL), ``stop``
(SIGSTOP to itself), ``raise`` (RuntimeError), ``sleep:SECONDS``, ``spin`` (a regular expression
that never finishes while holding the GIL: a stuck loop no Python thread can interrupt).
``@N`` fires on the N-th hit only.
Unarmed, a failpoint costs one dict lookup.

One failpoint is no place but a refusal: ``refuse_first=every:N`` makes the relay reject the
first attempt of every row whose id is a multiple of N before any backend sees it, as a backend
refuses a job (an attempt counted, the row retried with backoff). Deterministic across restarts:
a row's attempts are in its row, so a refusal the crash of a drain left unsettled is made again.
"""

from __future__ import annotations

import os
import re
import signal
import time

from drain import errors

NAMES = (
    "after_lock",
    "after_select",
    "mid_publish",
    "after_publish",
    "after_delete",
    "after_commit",
    "before_arm",  # idle: after "when is the next row due?", before the wake-up is armed
    "refuse_first",  # not a place: every:N rejects the first attempt of the rows with id % N == 0
)
REFUSED = "failpoint refuse_first: the first attempt of row {} refused"
EXIT_CODE = 137


class Failpoints:
    def __init__(self, spec: str = "") -> None:
        self._armed: dict[str, tuple[str, int]] = {}
        self._hits: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, _, action = item.partition("=")
            action, _, nth = action.partition("@")
            if name not in NAMES or not action:
                raise errors.ConfigError(f"DRAIN_FAILPOINTS: unknown failpoint {item!r}")
            self._armed[name] = (action, int(nth) if nth.isascii() and nth.isdigit() else 0)
        self.refuse_every = self._refusal(self._armed.get("refuse_first"))
        """N of ``refuse_first=every:N``; 0 when unarmed."""

    @staticmethod
    def _refusal(armed: tuple[str, int] | None) -> int:
        if armed is None:
            return 0
        every = armed[0].removeprefix("every:")
        if not (armed[0].startswith("every:") and every.isascii() and every.isdigit() and int(every) > 0):
            raise errors.ConfigError("DRAIN_FAILPOINTS: refuse_first takes every:N (N a positive integer)")
        return int(every)

    def refuses(self, row_id: int, attempts: int) -> bool:
        """Whether ``refuse_first`` rejects this attempt of the row (armed: its first, id % N == 0)."""
        return self.refuse_every > 0 and attempts == 0 and row_id % self.refuse_every == 0

    def hit(self, name: str) -> None:
        armed = self._armed.get(name)
        if armed is None:
            return
        action, nth = armed
        self._hits[name] = count = self._hits.get(name, 0) + 1
        if nth and count != nth:
            return
        if action == "exit":
            os._exit(EXIT_CODE)
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "raise":
            raise RuntimeError(f"failpoint {name}")
        elif action.startswith("sleep:"):
            time.sleep(float(action.removeprefix("sleep:")))
        elif action == "spin":
            re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking: never returns
