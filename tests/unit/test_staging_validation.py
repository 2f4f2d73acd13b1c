"""stage()/stage_many() refuse bad arguments before touching the database."""

from __future__ import annotations

import datetime
import functools
import json
import types
from typing import Any

import pytest

import drain
from drain import errors
from drain.staging import rows as staging_rows
from drain.store import sql


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
        ({"job_name": "app.\x00tasks"}, "job_name must not contain a NUL"),
        ({"queue": "mail\x00"}, "queue must not contain a NUL"),
        ({"backend": "\x00"}, "backend must not contain a NUL"),
        ({"job_name": "app.\ud800"}, "job_name is not valid Unicode"),
        ({"args": ["a\x00b"]}, "a string holds a NUL character"),
        ({"kwargs": {"k\x00": 1}}, "a key holds a NUL character"),
        ({"options": {"k": {"nested": "\x00"}}}, "a string holds a NUL character"),
        ({"args": ["\udc80"]}, "args is not valid Unicode"),
        ({"kwargs": {"\ud800": 1}}, "kwargs is not valid Unicode"),
        ({"args": [{1: "x"}]}, "non-string key 1"),
        ({"args": [{None: "x"}]}, "non-string key None"),
        ({"args": [float("inf")]}, "inf is not a JSON number"),
        ({"args": [10**5000]}, "args must be JSON-serialisable"),
        ({"args": [b"bytes"]}, "bytes is not a JSON type"),
        ({"args": [{1, 2}]}, "set is not a JSON type"),
        ({"args": ["x" * (1 << 20)]}, "the limit is"),
        ({"delay": 10**400}, "delay must be at most"),
        ({"delay": 1e12}, "delay must be at most"),
        ({"delay": float("nan")}, "delay must be seconds or a timedelta"),
        ({"delay": True}, "delay must be seconds or a timedelta"),
        ({"job_id": 12345}, "job_id must be a UUID, not int"),
        ({"job_id": "x" * 10000}, "job_id must be a UUID"),
        ({"on_conflict": "replace"}, 'on_conflict must be None or "ignore"'),
        ({"ordering_key": ""}, "ordering_key must not be empty or blank"),
        ({"ordering_key": " \t\n\r\f\x0b"}, "ordering_key must not be empty or blank"),
        ({"ordering_key": 42}, "ordering_key must be None or a string, not int"),
        ({"ordering_key": b"order-42"}, "ordering_key must be None or a string, not bytes"),
        ({"ordering_key": "order\x0042"}, "ordering_key must not contain a NUL"),
        ({"ordering_key": "order-\ud800"}, "ordering_key is not valid Unicode"),
        ({"ordering_key": "k" * 256}, "ordering_key is 256 bytes; the limit is 255"),
        ({"ordering_key": "k" * 254 + "é"}, "ordering_key is 256 bytes; the limit is 255"),
    ],
)
def test_bad_arguments_raise_before_the_database(kwargs: dict[str, Any], message: str) -> None:
    job_name = kwargs.pop("job_name", "app.tasks.send_email")
    with pytest.raises(errors.StagingError, match=message):
        drain.stage(NoDatabase(), job_name, **kwargs)


def nested(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth):
        value = [value]
    return value


def test_nesting_is_bounded() -> None:
    drain.stage(Recording(), "app.tasks.a", args=nested(staging_rows.MAX_JSON_DEPTH - 1))
    with pytest.raises(errors.StagingError, match="nested deeper than"):
        drain.stage(NoDatabase(), "app.tasks.a", args=nested(staging_rows.MAX_JSON_DEPTH))
    with pytest.raises(errors.StagingError, match="nested deeper than"):
        drain.stage(NoDatabase(), "app.tasks.a", kwargs={"deep": nested(100_000)})  # no RecursionError


class Recording:
    """A connection stand-in that keeps what would be sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def execute(self, statement: str, params: Any) -> Recording:
        self.sent.append((statement, params))
        return self

    def fetchall(self) -> list[Any]:
        return []


def send_email(to: str) -> None:
    """A module-level function, as a worker imports it."""


class Mailer:
    def send(self) -> None:
        """A method."""

    @staticmethod
    def static() -> None:
        """A static method: importable as module.Mailer.static."""


def test_a_function_is_staged_by_its_dotted_path() -> None:
    conn = Recording()
    drain.stage(conn, send_email, args=["a@example.com"])
    drain.stage_many(conn, [drain.Job(send_email), {"job_name": Mailer.static}])
    assert conn.sent[0][1]["job_name"] == f"{__name__}.send_email"
    assert f'"job_name":"{__name__}.send_email"' in conn.sent[1][1]["jobs"]
    assert f'"job_name":"{__name__}.Mailer.static"' in conn.sent[1][1]["jobs"]


def test_callables_without_an_importable_path_are_refused() -> None:
    def inner() -> None:
        pass

    cases: list[tuple[object, str]] = [
        (lambda: None, "a lambda"),
        (inner, "defined inside a function"),
        (Mailer().send, "bound method"),
        (functools.partial(send_email, "x"), "no importable dotted path"),
        (42, "must be a non-empty string or a function"),
    ]
    for value, message in cases:
        with pytest.raises(errors.StagingError, match=message):
            drain.stage(NoDatabase(), value)  # type: ignore[call-overload]
    main_function = types.FunctionType(send_email.__code__, {"__name__": "__main__"}, "job")
    with pytest.raises(errors.StagingError, match="__main__"):
        drain.stage(NoDatabase(), main_function)


def test_the_json_sent_is_what_was_given() -> None:
    conn = Recording()
    args = ["é", "💌", "\\u0000 is text here", 10**30, -0.5, True, None, {"k": [1, {"n": "v"}]}]
    drain.stage(conn, "app.tasks.a", args=args, kwargs={"ключ": "值"})
    drain.stage_many(conn, [drain.Job("app.tasks.a", args=args, kwargs={"ключ": "值"})])
    assert json.loads(conn.sent[0][1]["job_args"]) == args
    assert json.loads(conn.sent[0][1]["job_kwargs"]) == {"ключ": "值"}
    (row,) = json.loads(conn.sent[1][1]["jobs"])
    assert row["job_args"] == args and row["job_kwargs"] == {"ключ": "值"}


def test_sync_stage_refuses_an_awaitable_result() -> None:
    class LooksSync:
        def execute(self, *args: Any) -> Any:
            async def never() -> None:
                raise AssertionError("must not run")

            return never()

    with pytest.raises(errors.StagingError, match="asyncio connection"):
        drain.stage(LooksSync(), "app.tasks.a")


def test_stage_many_names_the_bad_position() -> None:
    jobs = [drain.Job("app.tasks.a"), {"job_name": "app.tasks.b", "args": "oops"}]
    with pytest.raises(errors.StagingError, match="job 1: args must be a list"):
        drain.stage_many(NoDatabase(), jobs)
    with pytest.raises(errors.StagingError, match="job 0:"):
        drain.stage_many(NoDatabase(), [{"job_nam": "typo"}])


def test_stage_many_refuses_what_is_not_jobs() -> None:
    for jobs in ("app.tasks.a", {"job_name": "a.b"}, [42]):
        with pytest.raises(errors.StagingError):
            drain.stage_many(NoDatabase(), jobs)  # type: ignore[call-overload]


def test_stage_many_of_nothing_sends_nothing() -> None:
    assert drain.stage_many(NoDatabase(), []) == []


def test_not_a_connection() -> None:
    with pytest.raises(errors.StagingError, match="not a database connection"):
        drain.stage(object(), "app.tasks.a")


def test_staging_error_is_a_value_error() -> None:
    assert issubclass(errors.StagingError, ValueError)
    assert issubclass(errors.StagingError, errors.DrainError)


KEYED_STATEMENTS = {
    "insert_keyed_job",
    "insert_keyed_job_if_absent",
    "insert_keyed_jobs",
    "insert_keyed_jobs_if_absent",
}


def test_staging_statements_and_function_names_are_pinned() -> None:
    assert (
        set(sql.raw_queries("staging.sql"))
        == {"insert_job_if_absent", "insert_jobs_if_absent"} | KEYED_STATEMENTS
    )
    assert sql.Names("public", "staged_jobs").stage_function == "drain_stage_v1"
    assert sql.Names("public", "other").stage_function == "other_stage_v1"
    assert sql.Names("public", "staged_jobs").stage_function_v2 == "drain_stage_v2"
    assert sql.Names("public", "other").stage_function_v2 == "other_stage_v2"
    text = sql.functions(sql.Names("My Schema", 'we"ird')).as_string(None)
    assert 'FUNCTION "My Schema"."we""ird_stage_v1"(' in text
    assert 'FUNCTION "My Schema"."we""ird_stage_v2"(' in text
    assert 'INSERT INTO "My Schema"."we""ird"' in text


def test_staging_never_commits_or_opens_a_transaction() -> None:
    for name in ("insert_job_if_absent", "insert_jobs_if_absent", *KEYED_STATEMENTS):
        lines = sql.raw_queries("staging.sql")[name].splitlines()
        statement = " ".join(line for line in lines if not line.startswith("--")).upper()
        assert statement.startswith("INSERT INTO")
        assert "COMMIT" not in statement and "BEGIN" not in statement


def test_a_key_of_255_bytes_is_sent_as_given() -> None:
    conn = Recording()
    for key in ("k" * 255, "k" * 253 + "é", "🔑" * 63 + "abc", "\u00a0", " Order 42 ", "x"):
        drain.stage(conn, "app.tasks.a", ordering_key=key)
        assert conn.sent[-1][1]["ordering_key"] == key


def test_only_keyed_jobs_name_the_ordering_key_column() -> None:
    """An unkeyed job's statement is the one of a release before ordering_key, so a producer
    role granted INSERT on the columns of then (without ordering_key) stages it as before."""
    conn = Recording()
    drain.stage(conn, "app.tasks.a")
    drain.stage(conn, "app.tasks.a", ordering_key=None, on_conflict="ignore")
    drain.stage_many(conn, [drain.Job("app.tasks.a"), {"job_name": "app.tasks.b", "ordering_key": None}])
    drain.stage_many(conn, [drain.Job("app.tasks.a")], on_conflict="ignore")
    for statement, params in conn.sent:
        assert "ordering_key" not in statement and "ordering_key" not in str(params)
    conn.sent.clear()
    drain.stage(conn, "app.tasks.a", ordering_key="order-42")
    drain.stage(conn, "app.tasks.a", ordering_key="order-42", on_conflict="ignore")
    drain.stage_many(conn, [drain.Job("app.tasks.a"), drain.Job("app.tasks.b", ordering_key="order-42")])
    drain.stage_many(conn, [{"job_name": "app.tasks.a", "ordering_key": "order-42"}], on_conflict="ignore")
    texts = [statement for statement, _ in conn.sent]
    assert all("ordering_key" in text for text in texts)
    assert texts[1].count("ON CONFLICT") == texts[3].count("ON CONFLICT") == 1
    assert "ON CONFLICT" not in texts[0] + texts[2]
    rows = json.loads(conn.sent[2][1]["jobs"])
    assert [row.get("ordering_key") for row in rows] == [None, "order-42"]
    assert "ordering_key" not in rows[0]  # absent, which jsonb_to_recordset reads as NULL


def test_stage_many_names_the_position_of_a_bad_key() -> None:
    jobs = [
        drain.Job("app.tasks.a", ordering_key="ok"),
        {"job_name": "app.tasks.b", "ordering_key": "x" * 10**6},
    ]
    with pytest.raises(errors.StagingError) as refused:
        drain.stage_many(NoDatabase(), jobs)
    assert str(refused.value) == "job 1: ordering_key is 1000000 bytes; the limit is 255"
