"""sql.positional: the batch query with $n parameters, converted once (issue 26)."""

from __future__ import annotations

import re

import pytest

from drain.store import sql

NAMES = sql.Names("public", "staged_jobs")


def test_every_named_parameter_becomes_one_number_in_first_use_order() -> None:
    named = sql.query("select_due", NAMES).as_string(None)
    statement = sql.positional("select_due", NAMES)
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", named)))
    assert list(statement.order) == names
    assert "%(" not in statement.text
    numbers = {int(number) for number in re.findall(r"\$(\d+)", statement.text)}
    assert numbers == set(range(1, len(names) + 1))
    # each place a name stood now holds that name's number, the rest of the text unchanged
    back = re.sub(r"\$(\d+)", lambda match: f"%({statement.order[int(match.group(1)) - 1]})s", statement.text)
    assert back == named


def test_params_follow_the_order() -> None:
    statement = sql.Positional("SELECT $1, $2, $1", ("b", "a"))
    assert statement.params({"a": 1, "b": 2, "unused": 3}) == [2, 1]
    with pytest.raises(KeyError):
        statement.params({"a": 1})


def test_a_stray_percent_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sql.raw_queries("queries.sql"), "odd", "SELECT 1 WHERE 'a%' = %(x)s")
    sql.positional.cache_clear()
    try:
        with pytest.raises(ValueError, match="odd"):
            sql.positional("odd", NAMES)
    finally:
        sql.positional.cache_clear()
        sql.query.cache_clear()
