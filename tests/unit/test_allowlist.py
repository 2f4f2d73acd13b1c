"""allowed_jobs patterns match dotted names segment by segment (drain.backend.allowlist)."""

from __future__ import annotations

import datetime
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drain import backend, errors, models
from drain.backend import allowlist


def admits(patterns: list[str], name: str) -> bool:
    the_list, problems = allowlist.Allowlist.parse(patterns)
    assert problems == []
    return the_list.admits(name)


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("app.tasks.*", "app.tasks.send_email", True),
        ("app.tasks.*", "app.tasks.os.system", False),  # '*' never crosses a dot
        ("app.tasks.*", "app.tasks", False),
        ("app.tasks.*", "app.tasksx.send", False),
        ("app.tasks.send_*", "app.tasks.send_email", True),
        ("app.tasks.send_*", "app.tasks.delete", False),
        ("app.*.run", "app.mail.run", True),
        ("app.*.run", "app.mail.os.run", False),
        ("app.**", "app.mail.tasks.send", True),
        ("app.**", "app", True),
        ("app.**.send", "app.send", True),
        ("app.**.send", "app.a.b.send", True),
        ("app.**.send", "app.a.b.sendx", False),
        ("*", "eval", True),
        ("*", "os.system", False),
        ("app.tasks.*", "app..tasks", False),
        ("app.tasks.*", "app.tasks.", False),
        ("App.tasks.*", "app.tasks.x", False),  # case-sensitive
    ],
)
def test_segment_matching(pattern: str, name: str, expected: bool) -> None:
    assert admits([pattern], name) is expected


def test_bad_patterns_are_reported() -> None:
    _, problems = allowlist.Allowlist.parse(["app..x", "app.x**", "app.**"], allow_double_star=False)
    assert len(problems) == 3
    assert "empty segment" in problems[0]
    assert "whole segment" in problems[1]
    assert "not allowed for this backend" in problems[2]


segment = st.text(alphabet="abcxyz_", min_size=1, max_size=4)


@given(st.lists(segment, min_size=1, max_size=4), st.lists(segment, min_size=1, max_size=3))
def test_a_single_star_never_admits_a_longer_name(prefix: list[str], extra: list[str]) -> None:
    pattern = ".".join([*prefix, "*"])
    longer = ".".join([*prefix, *extra, "leaf"])
    assert not admits([pattern], longer)


@given(st.text(max_size=40))
def test_any_name_is_answered(name: str) -> None:
    assert admits(["app.**", "x.*"], name) in (True, False)


def job(row_id: int, name: str) -> models.StagedJob:
    return models.StagedJob(
        id=row_id,
        job_id=uuid.uuid4(),
        job_name=name,
        args=(),
        kwargs={},
        queue="q",
        backend="b",
        options={},
        created_at=datetime.datetime.now(datetime.UTC),
    )


def test_build_each_turns_exceptions_into_that_rows_rejection() -> None:
    def build(staged: models.StagedJob) -> str:
        if staged.job_name == "refused":
            raise errors.JobRefused("option x must be an integer")
        if staged.job_name == "boom":
            raise ValueError("surprise\nsecond line")
        return staged.job_name.upper()

    jobs = [job(1, "ok"), job(2, "refused"), job(3, "boom"), job(4, "fine")]
    built, rejected = backend.build_each(jobs, build, "rq")
    assert [(staged.id, message) for staged, message in built] == [(1, "OK"), (4, "FINE")]
    assert [(result.row_id, result.outcome) for result in rejected] == [
        (2, models.Outcome.REJECTED),
        (3, models.Outcome.REJECTED),
    ]
    assert rejected[0].error == "rq: option x must be an integer"
    assert rejected[1].error == "rq: ValueError: surprise"
