"""Relay.drain_due, what ``drain run --once`` runs: it leads as the loop does, forwards whole
batches until nothing is due, stops at the rows of an unavailable backend, and does nothing
where another drain leads."""

from __future__ import annotations

import dataclasses
import threading

import psycopg

import drain
from drain import config, testing
from drain.relay import loop as relay
from tests.conftest import ManualClock


def _relay(settings: config.Settings, memory: testing.MemoryAdapter, clock: ManualClock) -> relay.Relay:
    settings = dataclasses.replace(
        settings, batch_size=3, backends={"default": config.BackendSettings("default", "memory", 3, {})}
    )
    return relay.Relay(settings, {"default": memory}, clock=clock, jitter=lambda: 0.5)


def _stage(dsn: str, count: int) -> None:
    with psycopg.connect(dsn) as app:  # commits on leaving
        for n in range(count):
            drain.stage(app, f"app.tasks.n{n}")


def test_it_forwards_every_due_batch_and_adds_them_up(settings: config.Settings, clock: ManualClock) -> None:
    memory = testing.MemoryAdapter("default")
    _stage(settings.dsn, 7)
    the_relay = _relay(settings, memory, clock)
    try:
        total = the_relay.drain_due(threading.Event())
        assert the_relay.leadership.is_leader
    finally:
        the_relay.shutdown()
    assert total is not None
    assert (total.selected, total.published, total.skipped) == (7, 7, 0)
    assert len(memory.published) == 7


def test_it_stops_at_the_rows_of_an_unavailable_backend(
    settings: config.Settings, clock: ManualClock
) -> None:
    memory = testing.MemoryAdapter("default")
    memory.down = True
    _stage(settings.dsn, 2)
    the_relay = _relay(settings, memory, clock)
    try:
        total = the_relay.drain_due(threading.Event())
    finally:
        the_relay.shutdown()
    assert total is not None
    assert (total.selected, total.published, total.skipped) == (2, 0, 2)


def test_it_does_nothing_where_another_drain_leads(settings: config.Settings, clock: ManualClock) -> None:
    _stage(settings.dsn, 2)
    leader = _relay(settings, testing.MemoryAdapter("default"), clock)
    memory = testing.MemoryAdapter("default")
    other = _relay(settings, memory, clock)
    try:
        assert leader.begin_term()
        assert other.drain_due(threading.Event()) is None
        assert not other.leadership.is_leader and not memory.published
    finally:
        other.shutdown()
        leader.shutdown()


def test_a_stop_already_set_forwards_nothing(settings: config.Settings, clock: ManualClock) -> None:
    memory = testing.MemoryAdapter("default")
    _stage(settings.dsn, 2)
    the_relay = _relay(settings, memory, clock)
    stop = threading.Event()
    stop.set()
    try:
        total = the_relay.drain_due(stop)
    finally:
        the_relay.shutdown()
    assert total is not None and total.selected == 0 and not memory.published
