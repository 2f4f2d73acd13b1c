"""The SQL API (drain_stage_v1, created by ``drain migrate``) and the languages that call it.

Node (npm ``pg``), Ruby (Debian ``ruby-pg``) and Go (Debian ``lib/pq``) programs in tests/stacks
stage in a transaction held open while a real drain runs; only the committed job is delivered.
A missing runtime or driver skips locally and fails under CI=true (.ci/run installs them).
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from drain import config
from drain.store import session as store
from drain.store import sql
from tests.conftest import missing
from tests.stacks.harness import COMMITTED, ROLLED_BACK, StackRig, stack_fixture  # noqa: F401

STACKS = Path(__file__).resolve().parents[1] / "stacks"
LINE_TIMEOUT_S = 60.0
NODE_PG = STACKS / "node" / "node_modules" / "pg"
GO_PQ = Path("/usr/share/gocode/src/github.com/lib/pq")
STACK_KEY = "order-42-ünï-🔑"  # no blank: the line protocol splits on them


def fetch(conn: psycopg.Connection[tuple[object, ...]], query: str, *params: object) -> tuple[object, ...]:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row


def test_function_defaults_and_named_arguments(database: str) -> None:
    with psycopg.connect(database) as conn:
        (job_id,) = fetch(conn, "SELECT drain_stage_v1('app.tasks.a')")
        chosen = uuid.uuid4()
        (same,) = fetch(
            conn,
            "SELECT drain_stage_v1('app.tasks.b', '[1, 2]', job_kwargs => '{\"k\": 1}', queue => 'mail', "
            "delay_s => 60, job_id => %s, options => '{\"timeout\": 5}')",
            chosen,
        )
        assert same == chosen
        rows = conn.execute(
            "SELECT job_id, job_name, job_args, job_kwargs, queue, backend, run_at IS NOT NULL, options "
            "FROM staged_jobs ORDER BY id"
        ).fetchall()
    assert rows == [
        (job_id, "app.tasks.a", [], {}, "default", "default", False, {}),
        (chosen, "app.tasks.b", [1, 2], {"k": 1}, "mail", "default", True, {"timeout": 5}),
    ]


def test_function_v2_takes_v1s_arguments_and_an_ordering_key(database: str) -> None:
    with psycopg.connect(database) as conn:
        (unkeyed,) = fetch(conn, "SELECT drain_stage_v2('app.tasks.a')")
        chosen = uuid.uuid4()
        (same,) = fetch(
            conn,
            "SELECT drain_stage_v2('app.tasks.b', '[1, 2]', job_kwargs => '{\"k\": 1}', queue => 'mail', "
            "delay_s => 60, job_id => %s, options => '{\"timeout\": 5}', ordering_key => %s)",
            chosen,
            "order-42 é",
        )
        assert same == chosen
        (positional,) = fetch(
            conn,
            "SELECT drain_stage_v2('app.tasks.c', '[]', '{}', 'default', 'default', NULL, NULL, NULL, '{}', "
            "%s)",
            "order-42 é",
        )
        (explicit_null,) = fetch(conn, "SELECT drain_stage_v2('app.tasks.d', ordering_key => NULL)")
        rows = conn.execute(
            "SELECT job_id, job_name, job_args, job_kwargs, queue, backend, run_at IS NOT NULL, options, "
            "ordering_key FROM staged_jobs ORDER BY id"
        ).fetchall()
    assert rows == [
        (unkeyed, "app.tasks.a", [], {}, "default", "default", False, {}, None),
        (chosen, "app.tasks.b", [1, 2], {"k": 1}, "mail", "default", True, {"timeout": 5}, "order-42 é"),
        (positional, "app.tasks.c", [], {}, "default", "default", False, {}, "order-42 é"),
        (explicit_null, "app.tasks.d", [], {}, "default", "default", False, {}, None),
    ]


REFUSED_BY_BOTH = [
    ("('')", "job_name must be a non-empty string"),
    ("('  ')", "job_name must be a non-empty string"),
    ("(NULL)", "job_name must be a non-empty string"),
    ("('a.b', '{}')", "job_args must be a JSON array, not object"),
    ("('a.b', '\"x\"')", "job_args must be a JSON array, not string"),
    ("('a.b', NULL)", "job_args must be a JSON array, not NULL"),
    ("('a.b', job_kwargs => '[]')", "job_kwargs must be a JSON object"),
    ("('a.b', options => '1')", "options must be a JSON object"),
    ("('a.b', queue => '')", "queue must be a non-empty string"),
    ("('a.b', backend => NULL)", "backend must be a non-empty string"),
    ("('a.b', delay_s => -1)", "delay_s must be between 0"),
    ("('a.b', delay_s => 'NaN')", "delay_s must be between 0"),
    ("('a.b', delay_s => 'Infinity')", "delay_s must be between 0"),
    ("('a.b', delay_s => 1, run_at => now())", "give run_at or delay_s, not both"),
]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        *((f"drain_stage_v2{arguments}", message) for arguments, message in REFUSED_BY_BOTH),
        *(
            (f"drain_stage_v2('a.b'{more}, ordering_key => {key})", "ordering_key")
            for more in ("", ", delay_s => 5", ", job_id => gen_random_uuid()")
            for key in ("''", "' '", "E'\\t\\n '", "repeat('k', 256)", "repeat('é', 127) || 'kk'")
        ),
    ],
)
def test_function_v2_refuses_what_stage_refuses(database: str, call: str, message: str) -> None:
    refused(database, call, message)


def test_function_v2_accepts_every_key_up_to_255_bytes_as_given(database: str) -> None:
    keys = ["k" * 255, "é" * 127 + "k", "🔑" * 63 + "abc", "\u00a0", " \t.", " Order 42 "]
    with psycopg.connect(database) as conn:
        for key in keys:
            conn.execute("SELECT drain_stage_v2('a.b', ordering_key => %s)", [key])
        rows = conn.execute("SELECT ordering_key FROM staged_jobs ORDER BY id").fetchall()
    assert [row[0] for row in rows] == keys


CHECK_FUNCTIONS = "('drain_job_check_v1', 'drain_key_check_v1')"


def nested_calls(conn: psycopg.Connection[tuple[object, ...]], statement: str) -> dict[str, int]:
    """The calls of the table's check functions that ``statement`` makes, counted by PostgreSQL
    itself (track_functions, this transaction's own counters): a deterministic measure of the
    work beside the INSERT, where a timing would be noise."""
    query = (
        "SELECT p.proname, pg_stat_get_xact_function_calls(p.oid) FROM pg_proc p "
        f"WHERE p.proname IN {CHECK_FUNCTIONS} AND p.pronamespace = 'public'::regnamespace"
    )
    before = dict(conn.execute(query).fetchall())  # type: ignore[arg-type]
    conn.execute(statement)  # type: ignore[arg-type]
    after = dict(conn.execute(query).fetchall())  # type: ignore[arg-type]
    return {str(name): int(after[name] or 0) - int(before[name] or 0) for name in after}


@pytest.mark.parametrize("key", ["NULL", "'order-42'"])
def test_the_common_call_checks_nothing_the_insert_does_not(database: str, key: str) -> None:
    """drain_stage_v1 and drain_stage_v2's common call (no delay_s, no NULL but the key) pass
    one test and run no check of their own: the only checks are the table's, the same as a plain
    INSERT's (bench/README.md: what the function costs over the INSERT)."""
    insert = (
        "INSERT INTO staged_jobs (job_name, job_args, queue, ordering_key) "
        f"VALUES ('app.tasks.a', '[1]', 'mail', {key})"
    )
    v2 = f"SELECT drain_stage_v2('app.tasks.a', '[1]', queue => 'mail', ordering_key => {key})"
    with psycopg.connect(database) as conn:
        conn.execute("SET LOCAL track_functions = 'all'")
        by_insert = nested_calls(conn, insert)
        assert by_insert["drain_job_check_v1"] == 1
        assert nested_calls(conn, v2) == by_insert
        if key == "NULL":
            assert (
                nested_calls(conn, "SELECT drain_stage_v1('app.tasks.a', '[1]', queue => 'mail')")
                == by_insert
            )
        delayed = nested_calls(conn, v2.replace("queue =>", "delay_s => 5, queue =>"))
        assert delayed == by_insert  # delay_s: the guard's other tests, still no check function


@pytest.mark.parametrize(
    ("call", "message"), [(f"drain_stage_v1{arguments}", message) for arguments, message in REFUSED_BY_BOTH]
)
def test_function_refuses_what_stage_refuses(database: str, call: str, message: str) -> None:
    refused(database, call, message)


def refused(database: str, call: str, message: str) -> None:
    with psycopg.connect(database) as conn:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
            conn.execute(f"SELECT {call}")  # type: ignore[arg-type]
        conn.rollback()
        assert fetch(conn, "SELECT count(*) FROM staged_jobs") == (0,)


def test_function_with_a_configured_schema_and_table(database: str) -> None:
    settings = config.Settings(dsn=database, schema="Jobs Here", table="my_jobs")
    db = store.Store(settings)
    db.migrate()
    db.migrate()  # idempotent
    db.close()
    names = sql.Names("Jobs Here", "my_jobs")
    assert (names.stage_function, names.stage_function_v2) == ("my_jobs_stage_v1", "my_jobs_stage_v2")
    with psycopg.connect(database) as conn:
        (job_id,) = fetch(conn, "SELECT \"Jobs Here\".my_jobs_stage_v1('app.tasks.a', '[\"x\"]')")
        (keyed,) = fetch(conn, "SELECT \"Jobs Here\".my_jobs_stage_v2('app.tasks.a', ordering_key => 'k')")
        rows = conn.execute(
            'SELECT job_id, job_args, ordering_key FROM "Jobs Here".my_jobs ORDER BY id'
        ).fetchall()
        assert rows == [(job_id, ["x"], None), (keyed, [], "k")]
        assert fetch(conn, "SELECT count(*) FROM staged_jobs") == (0,)  # the default table untouched


class Program:
    """A stack program speaking the line protocol of tests/stacks/README.md."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self.popen = subprocess.Popen(
            argv, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def send(self, line: str) -> str:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()
        answer = self.popen.stdout.readline().strip()
        if not answer:
            self.popen.kill()
            _, err = self.popen.communicate(timeout=LINE_TIMEOUT_S)
            raise AssertionError(f"{self.popen.args!r} answered nothing to {line!r}: {err[-2000:]}")
        return answer

    def close(self) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.close()
        assert self.popen.wait(timeout=LINE_TIMEOUT_S) == 0


def staged_id(answer: str) -> uuid.UUID:
    assert answer.startswith("staged "), answer
    return uuid.UUID(answer.removeprefix("staged "))


def ordering_keys(dsn: str) -> list[tuple[uuid.UUID, str | None]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT job_id, ordering_key FROM staged_jobs ORDER BY id").fetchall()
    return [(job_id, key) for job_id, key in rows]


def prove(stack: StackRig, program: Program) -> None:
    """The stack's job through drain_stage_v1 and its keyed job through drain_stage_v2: committed
    (with the key as given, multibyte characters and all) or rolled back, then delivered."""
    try:
        plain = staged_id(program.send(f"stage {COMMITTED.replace(' ', '_')}"))
        stack.drain_sees_nothing()
        assert program.send("commit") == "ok"
        keyed = staged_id(program.send(f"stage-keyed {COMMITTED} {STACK_KEY}"))
        assert program.send("commit") == "ok"
        assert program.send("stage rolled_back").startswith("staged ")
        assert program.send(f"stage-keyed rolled_back {STACK_KEY}").startswith("staged ")
        assert program.send("rollback") == "ok"
        answer = program.send("bad")
        assert answer.startswith("error ") and "job_name must be a non-empty string" in answer, answer
        answer = program.send("bad-key")
        assert answer.startswith("error ") and "ordering_key" in answer, answer
    finally:
        program.close()
    assert ordering_keys(stack.dsn) == [(plain, None), (keyed, STACK_KEY)]
    stack.only_committed_delivered(expected=2)


@pytest.fixture
def node() -> str:
    found = shutil.which("node")
    if found is None:
        missing("node is not installed (Debian package nodejs)")
    if not NODE_PG.is_dir():
        missing("the npm package pg is not installed in tests/stacks/node (.ci/run runs npm ci there)")
    return found


@pytest.fixture
def ruby() -> str:
    found = shutil.which("ruby")
    if found is None:
        missing("ruby is not installed (Debian package ruby-pg brings it)")
    done = subprocess.run([found, "-e", "require 'pg'"], capture_output=True, check=False)
    if done.returncode != 0:
        missing("the Ruby pg library is not installed (Debian package ruby-pg)")
    return found


@pytest.fixture
def go_program(tmp_path: Path) -> Iterator[str]:
    go = shutil.which("go")
    if go is None:
        missing("go is not installed (Debian package golang-go)")
    if not GO_PQ.is_dir():
        missing("lib/pq is not installed (Debian package golang-github-lib-pq-dev)")
    binary = tmp_path / "stage-go"
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "GOPATH": "/usr/share/gocode",
        "GO111MODULE": "off",
        "GOCACHE": str(tmp_path / "gocache"),
        "GOFLAGS": "",
    }
    done = subprocess.run(
        [go, "build", "-o", str(binary), "main.go"],
        cwd=STACKS / "go", env=env, capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    yield str(binary)


def test_node_pg(stack: StackRig, node: str) -> None:
    prove(stack, Program([node, "stage.js", stack.dsn, stack.queue], STACKS / "node"))


def test_ruby_pg(stack: StackRig, ruby: str) -> None:
    prove(stack, Program([ruby, "stage.rb", stack.dsn, stack.queue], STACKS / "ruby"))


def test_go_lib_pq(stack: StackRig, go_program: str) -> None:
    dsn = f"{stack.dsn}{'&' if '?' in stack.dsn else '?'}sslmode=disable"
    prove(stack, Program([go_program, dsn, stack.queue], STACKS / "go"))
