"""Red team 32: ``block_on_dead_letter`` when one key's rows go to two backends.

Found: README G9 said "A row that is dead-lettered lets its key go on, unless *its* backend sets
``block_on_dead_letter = true``" (the dead-lettered row's backend), while the batch query
(queries.sql key_free) asks the *waiting* row's backend (``backend <> ALL(dead_blocking)``), as
the setting's docstring says. The two readings part when one key's rows go to two backends (a key
is the table's, not a backend's). README G9 now says the code's reading ("unless the backend of
the rows behind it sets ..."): this test holds the code to it.
"""

from __future__ import annotations

import dataclasses

import psycopg
import pytest

from drain import config, testing
from drain.config.settings import BackendSettings
from drain.relay import loop as relay
from tests.conftest import ManualClock


def run(settings: config.Settings, clock: ManualClock, dead_on: str, next_on: str) -> list[str]:
    """Stage 'first' (on ``dead_on``, rejected until dead) then 'second' (on ``next_on``), both of
    key 'k'; step until 'first' is a dead letter and a few steps more; return what was published."""
    backends = {
        "strict": BackendSettings("strict", "memory", 1, {}, block_on_dead_letter=True),
        "lax": BackendSettings("lax", "memory", 1, {}),
    }
    settings = dataclasses.replace(settings, batch_size=100, backends=backends)
    adapters = {name: testing.MemoryAdapter(name) for name in backends}
    adapters[dead_on].behaviour = lambda job: "reject" if job.job_name == "first" else "ack"
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        for name, backend in (("first", dead_on), ("second", next_on)):
            conn.execute(
                "INSERT INTO staged_jobs (job_name, backend, ordering_key) VALUES (%s, %s, 'k')",
                (name, backend),
            )
        the_relay = relay.Relay(settings, adapters, jitter=lambda: 0.5, clock=clock)
        try:
            assert the_relay.leadership.try_acquire()
            for _ in range(5):
                the_relay.turn()
        finally:
            the_relay.shutdown()
        assert conn.execute("SELECT job_name FROM staged_jobs_dead").fetchall() == [("first",)]
    return [job.job_name for adapter in adapters.values() for job in adapter.published]


@pytest.mark.parametrize(
    ("dead_on", "next_on", "expected"),
    [
        ("strict", "strict", []),  # control: one backend, both readings agree
        ("lax", "lax", ["second"]),  # control
        ("strict", "lax", ["second"]),  # the waiting row's backend lets it go
        ("lax", "strict", []),  # the waiting row's backend holds it
    ],
)
def test_the_waiting_rows_backend_decides_whether_its_key_goes_on(
    settings: config.Settings, clock: ManualClock, dead_on: str, next_on: str, expected: list[str]
) -> None:
    assert run(settings, clock, dead_on, next_on) == expected
