"""One deadline over a whole backend call, shared by every socket wait of that call.

A client library bounds each wait on its socket (a connect, a handshake reply, a script's reply,
a confirm), so a slow link that answers every request just within its timeout stretches a call
of many round trips far past it: the batch's transaction stays open, up to the session's
idle-in-transaction fence. An adapter starts a :class:`Deadline` when a call begins (``open``,
``publish_batch``, ``submit``, ``ping``; ``collect`` ends at its ticket's) and gives each wait of
its client ``bound(own timeout)``: the smaller of that timeout and what is left of the call.

The relay opens a backend as part of the call that needs it (``open``, then the batch), so the
call right after ``open`` keeps ``open``'s deadline: connecting and publishing share one
publish timeout. Past the deadline ``bound`` returns None and the adapter fails the call as an
outage (BackendUnavailable, its connection dropped: a reply half read must not answer the next
command); the rows wait and go again. A read past it (``read_bound``) still takes what already
arrived: a pipelined batch collected late is answered by the reply waiting in the socket.
One clock read starts a call; each wait reads it once more.
"""

from __future__ import annotations

import math
import time

LAST_LOOK_S = 0.05  # a read past the deadline: what already arrived, a frame in the socket read whole


class Deadline:
    """When the backend call under way must end (``at``, monotonic seconds)."""

    __slots__ = ("_opened", "at", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.at = math.inf
        self._opened = False

    def opening(self) -> float:
        """Start the deadline of ``open`` (and of the call that follows it); return it."""
        self.at = time.monotonic() + self.timeout_s
        self._opened = True
        return self.at

    def start(self) -> float:
        """Start a call's deadline, or keep ``open``'s when the call follows it (and it has not
        passed: an ``open`` that ended at its deadline does not fail the next call); return it."""
        now = time.monotonic()
        if not (self._opened and self.at > now):
            self.at = now + self.timeout_s
        self._opened = False
        return self.at

    def until(self, at: float) -> None:
        """A call that ends at ``at`` (a ticket's deadline, counted from its submission)."""
        self.at = at
        self._opened = False

    def bound(self, own_s: float | None) -> float | None:
        """The wait for one socket operation: ``own_s`` (None: no bound of its own), or what is
        left of the call if less; None once the deadline passed."""
        left = self.at - time.monotonic()
        if left <= 0:
            return None
        return left if own_s is None or left < own_s else own_s

    def read_bound(self, own_s: float | None) -> float:
        """The wait for one read: ``bound(own_s)``, or at most LAST_LOOK_S once the deadline passed."""
        wait_s = self.bound(own_s)
        if wait_s is not None:
            return wait_s
        return LAST_LOOK_S if own_s is None else min(own_s, LAST_LOOK_S)
