"""Generated jobs against a real Postgres: stage()/stage_many() either stage a row Postgres
accepted, holding exactly what was given, or raise StagingError before anything is sent — and
the caller's transaction stays usable either way (issue 10, item 8: NUL, surrogates, huge ints,
NaN, non-string keys, deep nesting)."""

from __future__ import annotations

import datetime
import json
import uuid
from typing import Any

import psycopg
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import drain

# Every code point, surrogates and NUL included.
ANY_TEXT = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=()), max_size=12),
    st.sampled_from(["\x00", "a\x00b", "\ud800", "x\udfff", "\ud83d\ude00", "\\u0000", "💌", ""]),
)
NAMES = st.one_of(ANY_TEXT, st.sampled_from(["app.tasks.a", "", " ", "a\x00b"]), st.integers(), st.none())


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def power_of_ten(digits: int) -> int:
    return int(10**digits)


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 10**200]),
    st.builds(power_of_ten, st.sampled_from([4299, 5000])),  # past Python's int-to-str limit
    st.floats(),
    ANY_TEXT,
    st.builds(nested, st.integers(0, 80)),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(ANY_TEXT, inner, max_size=4),
        st.dictionaries(st.one_of(ANY_TEXT, st.integers(), st.none()), inner, max_size=2),
    ),
    max_leaves=12,
)
DELAYS = st.one_of(
    st.none(),
    st.floats(),
    st.integers(),
    st.timedeltas(),
    st.sampled_from([-1, 3 * 10**9, 4 * 10**9]),
    st.builds(power_of_ten, st.just(400)),
)
RUN_AT = st.one_of(
    st.none(),
    st.datetimes(timezones=st.sampled_from([datetime.UTC, datetime.timezone(datetime.timedelta(hours=-12))])),
    st.datetimes(),
)
JOB_IDS = st.one_of(st.none(), st.uuids(), st.builds(str, st.uuids()), ANY_TEXT, st.integers())
# Mostly-valid fields with hostile values mixed in, so that both outcomes are exercised often.
GOOD_NAMES = st.one_of(
    st.just("app.tasks.a"), st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){0,3}", fullmatch=True)
)
TIMING = st.one_of(
    st.just({}),
    st.fixed_dictionaries({"delay": DELAYS}),
    st.fixed_dictionaries({"run_at": RUN_AT}),
    st.fixed_dictionaries({"delay": DELAYS, "run_at": RUN_AT}),
)
JOBS = st.builds(
    lambda fields, timing: {**fields, **timing},
    st.fixed_dictionaries(
        {"job_name": st.one_of(GOOD_NAMES, GOOD_NAMES, NAMES)},
        optional={
            "args": st.one_of(st.lists(JSON, max_size=4), st.lists(JSON, max_size=4), JSON),
            "kwargs": st.one_of(st.dictionaries(ANY_TEXT, JSON, max_size=4), JSON),
            "options": st.one_of(st.dictionaries(ANY_TEXT, JSON, max_size=3), JSON),
            "queue": st.one_of(GOOD_NAMES, NAMES),
            "backend": st.one_of(GOOD_NAMES, NAMES),
            "job_id": JOB_IDS,
        },
    ),
    TIMING,
)


def stored(conn: psycopg.Connection[Any], job_id: uuid.UUID) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT job_name, job_args, job_kwargs, queue, backend, options FROM staged_jobs WHERE job_id = %s",
        (job_id,),
    ).fetchone()
    assert row is not None, "stage() returned an id that is not staged"
    return tuple(row)


def as_jsonb(conn: psycopg.Connection[Any], value: Any) -> Any:
    """What Postgres makes of ``value`` as JSON: a number is a decimal there, so a float written
    with an exponent (4.4e+16) reads back as the integer it denotes."""
    row = conn.execute("SELECT %s::jsonb", (json.dumps(value),)).fetchone()
    assert row is not None
    return row[0]


def expected(conn: psycopg.Connection[Any], job: dict[str, Any]) -> tuple[Any, ...]:
    return (
        job["job_name"],
        as_jsonb(conn, list(job.get("args", []))),
        as_jsonb(conn, dict(job.get("kwargs") or {})),
        job.get("queue", "default"),
        job.get("backend", "default"),
        as_jsonb(conn, dict(job.get("options") or {})),
    )


def count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    assert row is not None
    return int(row[0])


def check_one(conn: psycopg.Connection[Any], job: dict[str, Any], many: bool) -> None:
    before = count(conn)
    try:
        if many:
            (job_id,) = drain.stage_many(conn, [job])
        else:
            job_id = drain.stage(conn, **job)
    except drain.StagingError as exc:
        event(f"refused: {str(exc).split(':')[-1][:40]}")
        assert count(conn) == before  # nothing was sent, and the transaction still answers
        return
    event("staged")
    assert stored(conn, job_id) == expected(conn, job)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=JOBS, many=st.booleans())
def test_generated_jobs_stage_or_refuse_cleanly(database: str, job: dict[str, Any], many: bool) -> None:
    with psycopg.connect(database) as conn:
        try:
            check_one(conn, job, many)
        finally:
            conn.rollback()


HOSTILE = st.one_of(SCALARS, st.sampled_from(["\x00", "a\x00b", "\ud800", "\\u0000", float("nan"), -0.0]))
PLACES = ["args", "args_nested", "kwargs", "kwargs_key", "options", "job_name", "queue", "backend"]


def place(where: str, value: Any) -> dict[str, Any]:
    """An otherwise valid job with ``value`` in one place."""
    job: dict[str, Any] = {"job_name": "app.tasks.a"}
    if where == "args":
        job["args"] = [1, value]
    elif where == "args_nested":
        job["args"] = [{"k": [value]}]
    elif where == "kwargs":
        job["kwargs"] = {"k": value}
    elif where == "kwargs_key":
        job["kwargs"] = {value: 1} if isinstance(value, str) else {"k": {repr(type(value)): value}}
    elif where == "options":
        job["options"] = {"o": value}
    else:
        job[where] = value
    return job


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(PLACES), value=HOSTILE, many=st.booleans())
def test_one_hostile_value_in_a_valid_job(database: str, where: str, value: Any, many: bool) -> None:
    with psycopg.connect(database) as conn:
        try:
            check_one(conn, place(where, value), many)
        finally:
            conn.rollback()


# Keys: any text Postgres holds (no NUL, no lone surrogate), blanks of every kind, and the edges of
# the 255 bytes.
def sized_key(size: int, last: str) -> str:
    """A key of ``size`` bytes of UTF-8 whose last character is ``last`` (1 to 4 bytes): the
    multibyte character straddles the limit or ends on it."""
    return "k" * (size - len(last.encode())) + last


TEXT_POSTGRES_HOLDS = st.characters(codec="utf-8", exclude_characters="\x00")
KEYS = st.one_of(
    st.text(TEXT_POSTGRES_HOLDS, max_size=8),
    st.text(TEXT_POSTGRES_HOLDS, min_size=60, max_size=300),
    st.sampled_from(
        ["", " ", "\t", "\n", "\x0b\x0c\r", "\u00a0", "\\", "'", '"', "%s", "\u2028", "\ufeff", "\U0010ffff"]
    ),
    st.builds(
        "".join, st.lists(st.sampled_from([" ", "\t", "\n", "\r", "\f", "\x0b", "\u00a0", "\u3000", "k"]))
    ),
    st.builds(sized_key, st.integers(250, 260), st.sampled_from(["k", "é", "€", "🔑"])),
)


def attempt(conn: psycopg.Connection[Any], statement: str, key: str) -> str | None:
    """Run ``statement`` with ``key`` in a savepoint; the key stored, or None when Postgres refused
    it with 22023 (any other error fails the test)."""
    try:
        with conn.transaction():
            conn.execute(statement.encode(), [key])
            row = conn.execute("SELECT ordering_key FROM staged_jobs ORDER BY id DESC LIMIT 1").fetchone()
    except psycopg.errors.InvalidParameterValue as exc:
        assert "ordering_key" in str(exc)
        return None
    assert row is not None
    return str(row[0])


def staged_by_python(conn: psycopg.Connection[Any], key: str, many: bool) -> str | None:
    before = count(conn)
    try:
        if many:
            (job_id,) = drain.stage_many(conn, [{"job_name": "app.tasks.a", "ordering_key": key}])
        else:
            job_id = drain.stage(conn, "app.tasks.a", ordering_key=key)
    except drain.StagingError as exc:
        assert str(exc).count("\n") == 0 and len(str(exc)) < 120  # one line, never the key itself
        assert count(conn) == before
        return None
    row = conn.execute("SELECT ordering_key FROM staged_jobs WHERE job_id = %s", [job_id]).fetchone()
    assert row is not None
    return str(row[0])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=KEYS, many=st.booleans())
def test_stage_the_sql_function_and_a_plain_insert_agree_on_every_key(
    database: str, key: str, many: bool
) -> None:
    """drain.stage() (and stage_many), drain_stage_v2 and a plain INSERT accept the same keys,
    store them byte for byte, and refuse the same: empty or blank (ASCII whitespace only, as the
    table's check trims), or over 255 bytes of UTF-8."""
    size = len(key.encode())
    blank = not key.strip(" \t\n\r\f\x0b")
    event("blank" if blank else "over 255 bytes" if size > 255 else "a key")
    with psycopg.connect(database) as conn:
        try:
            by_python = staged_by_python(conn, key, many)
            by_function = attempt(conn, "SELECT drain_stage_v2('app.tasks.a', ordering_key => %s)", key)
            by_insert = attempt(
                conn, "INSERT INTO staged_jobs (job_name, ordering_key) VALUES ('app.tasks.a', %s)", key
            )
        finally:
            conn.rollback()
    expected = None if blank or size > 255 else key
    assert by_python == by_function == by_insert == expected
