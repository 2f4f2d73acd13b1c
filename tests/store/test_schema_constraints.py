"""The table refuses what no backend can carry, and the three ways in agree on every edge.

For each value at the edge of the table's check (drain/store/sql/checks.sql, constraint
``drain_job_check``): a plain INSERT is refused with 22023 naming the column exactly when
``drain_stage_v1`` is refused with 22023 naming the argument, before inserting, and exactly when
``drain.stage()`` raises StagingError before sending anything (the caller's transaction stays
usable). On drain 0.1.0's schema the table took all of them, and a drain reading
``run_at => '-infinity'`` crashed.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import psycopg
import pytest

import drain

UTC = datetime.UTC


@dataclasses.dataclass(frozen=True)
class Edge:
    column: str
    sql: str  # the value as SQL
    python: Any = None  # the same value for drain.stage(), when Python can hold it
    refused: bool = True

    def __str__(self) -> str:
        return f"{self.column}={self.sql[:24]}"


EDGES = [
    Edge("run_at", "'-infinity'"),
    Edge("run_at", "'infinity'"),
    Edge("run_at", "'294276-12-31 00:00:00+00'"),
    Edge("run_at", "'0001-01-01 00:00:00+00'", datetime.datetime(1, 1, 1, tzinfo=UTC)),
    Edge(
        "run_at", "'1969-12-31 23:59:59.999999+00'", datetime.datetime(1969, 12, 31, 23, 59, 59, 999999, UTC)
    ),
    Edge("run_at", "'1970-01-01 00:00:00+00'", datetime.datetime(1970, 1, 1, tzinfo=UTC), refused=False),
    Edge(
        "run_at",
        "'9998-12-31 23:59:59+00'",
        datetime.datetime(9998, 12, 31, 23, 59, 59, tzinfo=UTC),
        refused=False,
    ),
    Edge("run_at", "'9999-01-01 00:00:00+00'", datetime.datetime(9999, 1, 1, tzinfo=UTC)),
    Edge("created_at", "'-infinity'"),
    Edge("created_at", "'1969-12-31 23:59:59+00'"),
    Edge("created_at", "'1970-01-01 00:00:00+00'", refused=False),
    Edge("created_at", "'infinity'"),
    Edge("job_name", "E' \\t\\n'", " \t\n"),
    Edge("job_name", "repeat('x', 1024)", "x" * 1024, refused=False),
    Edge("job_name", "repeat('x', 1025)", "x" * 1025),
    Edge("job_name", "repeat('é', 512)", "é" * 512, refused=False),
    Edge("job_name", "repeat('é', 513)", "é" * 513),  # 1026 bytes: bytes count
    Edge("queue", "' '", " "),
    Edge("queue", "repeat('q', 1025)", "q" * 1025),
    Edge("queue", "'mail'", "mail", refused=False),
    Edge("backend", "E'\\r'", "\r"),
    Edge("backend", "repeat('b', 1025)", "b" * 1025),
    Edge("attempts", "-1"),
    Edge("attempts", "2147483647", refused=False),
]
FUNCTION_ARGUMENTS = {"run_at", "job_name", "queue", "backend"}
STAGE_KEYWORDS = {"run_at": "run_at", "queue": "queue", "backend": "backend"}


def count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    return int(row[0]) if row else -1


def test_insert_function_and_stage_refuse_the_same_values(database: str) -> None:
    with psycopg.connect(database) as conn:
        for edge in EDGES:
            values = {"job_name": "'app.t'", edge.column: edge.sql}
            insert = f"INSERT INTO staged_jobs ({', '.join(values)}) VALUES ({', '.join(values.values())})"
            before = count(conn)
            try:
                with conn.transaction():
                    conn.execute(insert)  # type: ignore[call-overload]
                inserted = True
            except psycopg.errors.InvalidParameterValue as exc:
                inserted = False
                assert str(exc).startswith(f"drain: {edge.column} must"), edge
            assert inserted is not edge.refused, f"INSERT {edge}"

            if edge.column in FUNCTION_ARGUMENTS:
                arguments = {"job_name": "'app.t'", edge.column: edge.sql}
                call = ", ".join(f"{name} => {value}" for name, value in arguments.items())
                try:
                    with conn.transaction():
                        conn.execute(f"SELECT drain_stage_v1({call})")  # type: ignore[call-overload]
                    called = True
                except psycopg.errors.InvalidParameterValue as exc:
                    called = False
                    assert str(exc).startswith(f"drain: {edge.column} must be"), edge
                assert called is not edge.refused, f"drain_stage_v1 {edge}"

            if edge.python is not None:
                keyword = STAGE_KEYWORDS.get(edge.column)
                name = edge.python if edge.column == "job_name" else "app.t"
                options = {keyword: edge.python} if keyword else {}
                try:
                    drain.stage(conn, name, **options)
                    staged = True
                except drain.StagingError as exc:
                    staged = False
                    assert str(exc).startswith(edge.column), edge
                assert staged is not edge.refused, f"drain.stage {edge}"
                conn.execute("SELECT 1")  # a StagingError left the transaction usable
            expected = sum([not edge.refused, edge.column in FUNCTION_ARGUMENTS and not edge.refused]) + (
                edge.python is not None and not edge.refused
            )
            assert count(conn) == before + expected, edge
        conn.rollback()


@pytest.mark.parametrize("value", ["'-infinity'", "'infinity'"])
def test_an_update_cannot_bring_back_what_an_insert_may_not(database: str, value: str) -> None:
    with psycopg.connect(database) as conn:
        drain.stage(conn, "app.t")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=r"^drain: run_at must"):
            conn.execute(f"UPDATE staged_jobs SET run_at = {value}")  # type: ignore[call-overload]
