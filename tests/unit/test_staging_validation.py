"""stage()/stage_many() refuse bad arguments before touching the database."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

import drain
from drain import errors


class NoDatabase:
    """A connection stand-in that fails the test if anything is sent."""

    def execute(self, *args: Any) -> None:
        raise AssertionError("nothing may reach the database for a bad job")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"job_name": ""}, "job_name must be a non-empty string"),
        ({"job_name": None}, "job_name must be a non-empty string"),
        ({"args": "abc"}, "args must be a list or tuple"),
        ({"args": [object()]}, "args must be JSON-serialisable"),
        ({"args": [float("nan")]}, "args must be JSON-serialisable"),
        ({"kwargs": {1: "x"}}, "kwargs must be a mapping with string keys"),
        ({"run_at": datetime.datetime(2030, 1, 1)}, "run_at must be timezone-aware"),
        ({"run_at": "2030-01-01"}, "run_at must be a datetime"),
        ({"delay": -1}, "delay must not be negative"),
        ({"delay": "soon"}, "delay must be seconds or a timedelta"),
        ({"delay": 5, "run_at": datetime.datetime.now(datetime.UTC)}, "give run_at or delay, not both"),
        ({"job_id": "not-a-uuid"}, "job_id must be a UUID"),
        ({"queue": ""}, "queue must be a non-empty string"),
        ({"options": ["x"]}, "options must be a mapping"),
    ],
)
def test_bad_arguments_raise_before_the_database(kwargs: dict[str, Any], message: str) -> None:
    job_name = kwargs.pop("job_name", "app.tasks.send_email")
    with pytest.raises(errors.StagingError, match=message):
        drain.stage(NoDatabase(), job_name, **kwargs)


def test_stage_many_names_the_bad_position() -> None:
    jobs = [drain.Job("app.tasks.a"), {"job_name": "app.tasks.b", "args": "oops"}]
    with pytest.raises(errors.StagingError, match="job 1: args must be a list"):
        drain.stage_many(NoDatabase(), jobs)
    with pytest.raises(errors.StagingError, match="job 0:"):
        drain.stage_many(NoDatabase(), [{"job_nam": "typo"}])


def test_stage_many_of_nothing_sends_nothing() -> None:
    assert drain.stage_many(NoDatabase(), []) == []


def test_not_a_connection() -> None:
    with pytest.raises(errors.StagingError, match="not a database connection"):
        drain.stage(object(), "app.tasks.a")


def test_staging_error_is_a_value_error() -> None:
    assert issubclass(errors.StagingError, ValueError)
    assert issubclass(errors.StagingError, errors.DrainError)
