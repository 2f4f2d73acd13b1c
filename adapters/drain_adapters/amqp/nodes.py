"""Which node of a RabbitMQ cluster to connect to, for the RabbitMQ backend and Celery on AMQP. No I/O.

The nodes are tried in the configured order, starting where the last connection was made, and
one ``open`` shares one connect timeout among them::

    node connects                     -> the next open starts there again (stick to a good node)
    node refuses or times out         -> try the next one while the connect timeout lasts;
                                         the next open starts after it
    a connection that worked fails    -> the next open starts at the node after it
    less than MIN_ATTEMPT_S left      -> stop; the next open starts at that untried node

In order rather than shuffled: there is one drain publishing, so spreading connections over the
nodes buys nothing, while a fixed order lets an operator name the preferred node first and read
from the logs where the drain is. A dead node (connection refused) costs a round trip; a silent
one costs what is left of the connect timeout once, after which it is tried last.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

MIN_ATTEMPT_S = 0.2  # not worth starting a connection attempt with less time than this


class NodeRotation:
    """The order in which ``count`` nodes are tried, remembered across connections."""

    def __init__(self, count: int, clock: Callable[[], float] = time.monotonic) -> None:
        if count < 1:
            raise ValueError("a cluster has at least one node")
        self.count = count
        self.start = 0
        self.current: int | None = None
        """The node of the live connection, if any."""
        self._clock = clock

    def attempts(self, budget_s: float) -> Iterator[tuple[int, float]]:
        """``(node index, seconds left)`` for each node to try now, within ``budget_s`` in all.
        The caller reports each outcome with ``connected`` or ``failed``."""
        deadline = self._clock() + budget_s
        first = self.start
        for step in range(self.count):
            index = (first + step) % self.count
            left = deadline - self._clock()
            if step and left < MIN_ATTEMPT_S:  # the first node is always tried
                self.start = index
                return
            yield index, left

    def connected(self, index: int) -> None:
        self.current = self.start = index

    def failed(self, index: int) -> None:
        """Connecting to ``index`` failed: the next open starts after it."""
        self.start = (index + 1) % self.count
        if self.current == index:
            self.current = None

    def lost(self) -> None:
        """The live connection failed (its node died, went silent or was cut off)."""
        if self.current is not None:
            self.failed(self.current)

    def closed(self) -> None:
        """The live connection was closed on purpose: the next open starts at the same node."""
        self.current = None
