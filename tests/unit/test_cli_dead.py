"""``drain dead list|retry|purge``: parsing, filters and the purge guard (no database needed)."""

from __future__ import annotations

import pytest

from drain import cli
from drain.cli.commands import dead
from drain.store import admin


def parse(*argv: str) -> admin.DeadFilter:
    return dead.dead_filter(cli.build_parser().parse_args(["dead", *argv]))


def test_filters_reach_the_query_parameters() -> None:
    filters = parse("list", "--backend", "events", "--queue", "q", "--job-name", "app.t", "--limit", "7")
    # besides the fields, the patterns of what the console's text filters leave unsearched
    assert (
        filters.params().items()
        >= {
            "backend": "events",
            "queue": "q",
            "job_name": "app.t",
            "ids": None,
            "limit": 7,
            # the console's filters: the CLI leaves them open
            "ordering_key": None,
            "since": None,
            "until": None,
            "error": None,
            "arg": None,
            "upto": None,
        }.items()
    )
    assert not filters.everything


@pytest.mark.parametrize(
    "field", ["backend", "queue", "job_name", "ordering_key", "since", "until", "error", "arg", "ids", "upto"]
)
def test_any_filter_but_the_limit_is_not_everything(field: str) -> None:
    value = [1] if field == "ids" else 1 if field == "upto" else "x"
    assert not admin.DeadFilter(**{field: value}).everything  # type: ignore[arg-type]
    assert admin.DeadFilter(limit=3, ids=[]).everything


def test_ids_and_no_filter() -> None:
    assert parse("retry", "--id", "3", "5").params()["ids"] == [3, 5]
    assert parse("retry").everything
    assert parse("purge", "--limit", "3").everything  # a limit alone still means "any row"


@pytest.mark.parametrize("argv", [["dead"], ["dead", "list", "--limit", "0"], ["dead", "purge", "--id", "x"]])
def test_usage_mistakes_exit_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv, env={})
    assert exit_.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("drain: ") and err.count("\n") == 1


def test_purge_everything_needs_yes_and_touches_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    # The DSN points nowhere: the guard answers before any connection is tried.
    code = cli.main(["dead", "purge", "--dsn", "postgresql://nobody@127.0.0.1:1/none"], env={})
    assert code == cli.EXIT_NOT_CONFIRMED
    err = capsys.readouterr().err
    assert "--yes" in err and err.count("\n") == 1
