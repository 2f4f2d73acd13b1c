"""The select's floor (drain.store.reading.Floor) never skips a committed row.

A snapshot held elsewhere on the primary keeps the index entries of every row the drain deleted
since; issue 35 measured a backlog 20 times longer under one held for 5 minutes, every select
walking them from the lowest id. The floor starts the walk where rows can still be. Ids are
numbered at INSERT and committed out of order, so a row with a lower id than one already seen,
forwarded and deleted can commit later: the floor must wait for it. These tests hold such a
producer open while the drain forwards the rows around it, and check the floor stays at or below
its id, then that its row is taken by an ordinary select (not the occasional walk from the
lowest id) once it commits. Each was seen to fail with the safeguard broken: the mark's writers
ignored (floor_writers returning none), or a row below the floor not dropping it.
"""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from drain import config
from drain.store import reading
from drain.store import session as store
from tests.conftest import ManualClock

INSERT = "INSERT INTO staged_jobs (job_name) VALUES ('tests.support.tasks.record') RETURNING id"


def stage(dsn: str, count: int = 1) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [conn.execute(INSERT).fetchone()[0] for _ in range(count)]  # type: ignore[index]


class Drain:
    """A Store stepped by hand: each step marks (when due), selects, deletes what it selected."""

    def __init__(self, settings: config.Settings) -> None:
        self.clock = ManualClock()
        self.db = store.Store(settings)
        self.db.reader.clock = self.clock
        self.forwarded: list[int] = []

    def step(self, *, full: bool = False) -> list[int]:
        """One batch; ``full``: the select that looks at every row is due (else it is not)."""
        self.clock.advance(reading.FLOOR_EVERY_S)
        reader = self.db.reader
        reader._selects = reading.FULL_EVERY if full else 0
        reader._everywhere_at = float("-inf") if full else self.clock()
        with self.db.batch() as batch:
            jobs = batch.select_due(100)
            batch.delete(jobs)
        ids = [job.id for job in jobs]
        self.forwarded += ids
        return ids

    @property
    def floor(self) -> int:
        return self.db.reader.floor.at()

    def close(self) -> None:
        self.db.close()


@pytest.fixture
def drain(settings: config.Settings) -> Drain:
    the_drain = Drain(settings)
    yield the_drain  # type: ignore[misc]
    the_drain.close()


def test_the_floor_rises_past_the_rows_deleted(settings: config.Settings, drain: Drain) -> None:
    ids = stage(settings.dsn, 50)
    for _ in range(5):
        drain.step()
    assert drain.forwarded == ids
    assert drain.floor == ids[-1] + 1  # nothing staged: just past the highest id forwarded
    later = stage(settings.dsn, 3)
    assert drain.step() == later


def test_a_row_numbered_before_others_and_committed_after_them_is_taken(
    settings: config.Settings, drain: Drain
) -> None:
    with psycopg.connect(settings.dsn) as producer:
        (late,) = producer.execute(INSERT).fetchone()  # type: ignore[misc]  # numbered, not committed
        after = stage(settings.dsn, 20)  # numbered after it, committed before it
        for _ in range(6):
            drain.step()
        assert drain.forwarded == after
        assert drain.floor <= late  # the open producer holds it: its row may still come
        producer.commit()
    assert drain.step() == [late]  # an ordinary select, from the floor
    for _ in range(3):
        drain.step()
    assert drain.floor > late


def test_a_row_brought_back_below_the_floor_is_taken_by_the_walk_from_the_lowest_id(
    settings: config.Settings, drain: Drain
) -> None:
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        (deferred,) = conn.execute(
            "INSERT INTO staged_jobs (job_name, run_at) VALUES ('tests.support.tasks.record', "
            "now() + interval '1 hour') RETURNING id"
        ).fetchone()  # type: ignore[misc]
        stage(settings.dsn, 10)
        for _ in range(4):
            drain.step()
        assert drain.floor > deferred
        conn.execute("UPDATE staged_jobs SET run_at = NULL WHERE id = %s", (deferred,))  # an operator
    assert drain.step() == []  # below the floor: not seen by an ordinary select
    assert drain.step(full=True) == [deferred]
    assert drain.floor == reading.LOWEST_ID  # dropped: it starts over


def test_the_idle_check_and_the_gauges_start_at_the_floor(settings: config.Settings, drain: Drain) -> None:
    stage(settings.dsn, 10)
    for _ in range(4):
        drain.step()
    floor = drain.floor
    assert floor > reading.LOWEST_ID
    assert drain.db.reader.gauge_params()["floor"] == floor
    drain.db.reader._everywhere_at = drain.clock()
    assert drain.db.reader.idle_params()["floor"] == floor
    drain.clock.advance(reading.FULL_EVERY_S)
    assert drain.db.reader.idle_params()["floor"] == reading.LOWEST_ID


@pytest.mark.slow
@hypothesis_settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["open", "commit", "abort", "stage", "step", "step", "step"]), st.integers(0, 3)
        ),
        min_size=5,
        max_size=40,
    )
)
@example([("open", 0), ("stage", 0), ("step", 0), ("step", 0), ("step", 0)])
def test_no_committed_row_is_ever_below_the_floor(
    settings: config.Settings, actions: list[tuple[str, int]]
) -> None:
    """Producers numbering rows and committing or aborting in any order, the drain stepping
    between: after each step the floor is at or below every row committed and not yet forwarded,
    and every open producer's row; at the end every committed row was forwarded, by ordinary
    selects."""
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs")
    drain = Drain(settings)
    producers: list[tuple[psycopg.Connection[tuple[int]], int]] = []
    committed: list[int] = []
    try:
        for action, which in actions:
            if action == "open":
                producer: psycopg.Connection[tuple[int]] = psycopg.connect(settings.dsn)
                (row_id,) = producer.execute(INSERT).fetchone()  # type: ignore[misc]
                producers.append((producer, row_id))
            elif action in ("commit", "abort") and producers:
                producer, row_id = producers.pop(which % len(producers))
                if action == "commit":
                    producer.commit()
                    committed.append(row_id)
                producer.close()
            elif action == "stage":
                committed += stage(settings.dsn, which + 1)
            elif action == "step":
                drain.step()
                waiting = [i for i in committed if i not in drain.forwarded]
                waiting += [row_id for _, row_id in producers]
                assert all(drain.floor <= i for i in waiting), (drain.floor, waiting)
        for producer, row_id in producers:
            producer.commit()
            committed.append(row_id)
            producer.close()
        producers = []
        for _ in range(4):
            drain.step()
        assert sorted(drain.forwarded) == sorted(committed)
    finally:
        for producer, _ in producers:
            producer.close()
        drain.close()
