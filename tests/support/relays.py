"""In-process relays over in-memory backends, for the tests of the loop (a real Postgres)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from drain import config, testing
from drain.relay import loop as relay


def leading(
    settings: config.Settings,
    adapters: Mapping[str, testing.MemoryAdapter],
    clock: Callable[[], float],
    *,
    jitter: float = 0.5,
    block_on_dead_letter: bool = False,
    **changes: object,
) -> relay.Relay:
    """A Relay that already holds the lock: batch_size 100, each adapter a ``memory`` backend
    with max_attempts 3 (and ``block_on_dead_letter``), ``changes`` applied to the settings, a
    fixed jitter."""
    settings = dataclasses.replace(
        settings,
        batch_size=100,
        backends={
            name: config.BackendSettings(name, "memory", 3, {}, block_on_dead_letter=block_on_dead_letter)
            for name in adapters
        },
        **changes,  # type: ignore[arg-type]
    )
    the_relay = relay.Relay(settings, dict(adapters), jitter=lambda: jitter, clock=clock)
    assert the_relay.leadership.try_acquire()
    return the_relay
