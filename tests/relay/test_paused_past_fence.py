"""A leader paused between its select and its publish for longer than the session's fence (the
idle-in-transaction timeout that ends its session, and frees the lock) publishes nothing when it
resumes: another drain may have published those rows, and the next ones of their keys, meanwhile.

Found by the lanes issue's fault plan: a drain SIGSTOPped past its fence and resumed would send its
stale batch after the new leader of the lane had moved on, a key's earlier job arriving after its
later one."""

from __future__ import annotations

import dataclasses

import psycopg
import pytest

from drain import config, errors, testing
from drain.relay import failpoints
from drain.relay import loop as relay
from tests.conftest import ManualClock


def _relay(settings: config.Settings, pause_s: float, adapter: testing.MemoryAdapter) -> relay.Relay:
    tuned = dataclasses.replace(
        settings, backends={"default": config.BackendSettings("default", "memory", 3, {})}, pipeline_depth=0
    )
    the_relay = relay.Relay(
        tuned,
        {"default": adapter},
        failpoints_=failpoints.Failpoints(f"after_select=sleep:{pause_s}"),
        clock=ManualClock(),
    )
    the_relay.forwarder.fence_s = 0.3  # the session's fence, shortened for the test
    assert the_relay.leadership.try_acquire()
    return the_relay


def _stage(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO staged_jobs (job_name) SELECT 'job' FROM generate_series(1, 5)")


def test_rows_selected_longer_ago_than_the_fence_are_not_published(
    settings: config.Settings, database: str
) -> None:
    _stage(database)
    adapter = testing.MemoryAdapter()
    the_relay = _relay(settings, 0.5, adapter)
    try:
        with pytest.raises(errors.LeadershipLost, match="past the session's fence"):
            the_relay.drain_once()
        assert adapter.published == []
    finally:
        the_relay.shutdown()


def test_a_pause_within_the_fence_publishes(settings: config.Settings, database: str) -> None:
    _stage(database)
    adapter = testing.MemoryAdapter()
    the_relay = _relay(settings, 0.01, adapter)
    try:
        assert the_relay.drain_once().selected == 5
        assert len(adapter.published) == 5
    finally:
        the_relay.shutdown()
