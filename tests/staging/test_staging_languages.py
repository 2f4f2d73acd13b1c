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


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("drain_stage_v1('')", "job_name must be a non-empty string"),
        ("drain_stage_v1('  ')", "job_name must be a non-empty string"),
        ("drain_stage_v1(NULL)", "job_name must be a non-empty string"),
        ("drain_stage_v1('a.b', '{}')", "job_args must be a JSON array, not object"),
        ("drain_stage_v1('a.b', '\"x\"')", "job_args must be a JSON array, not string"),
        ("drain_stage_v1('a.b', NULL)", "job_args must be a JSON array, not NULL"),
        ("drain_stage_v1('a.b', job_kwargs => '[]')", "job_kwargs must be a JSON object"),
        ("drain_stage_v1('a.b', options => '1')", "options must be a JSON object"),
        ("drain_stage_v1('a.b', queue => '')", "queue must be a non-empty string"),
        ("drain_stage_v1('a.b', backend => NULL)", "backend must be a non-empty string"),
        ("drain_stage_v1('a.b', delay_s => -1)", "delay_s must be between 0"),
        ("drain_stage_v1('a.b', delay_s => 'NaN')", "delay_s must be between 0"),
        ("drain_stage_v1('a.b', delay_s => 'Infinity')", "delay_s must be between 0"),
        ("drain_stage_v1('a.b', delay_s => 1, run_at => now())", "give run_at or delay_s, not both"),
    ],
)
def test_function_refuses_what_stage_refuses(database: str, call: str, message: str) -> None:
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
    assert names.stage_function == "my_jobs_stage_v1"
    with psycopg.connect(database) as conn:
        (job_id,) = fetch(conn, "SELECT \"Jobs Here\".my_jobs_stage_v1('app.tasks.a', '[\"x\"]')")
        assert fetch(conn, 'SELECT job_id, job_args FROM "Jobs Here".my_jobs') == (job_id, ["x"])
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


def prove(stack: StackRig, program: Program) -> None:
    try:
        assert program.send(f"stage {COMMITTED.replace(' ', '_')}").startswith("staged ")
        stack.drain_sees_nothing()
        assert program.send("commit") == "ok"
        assert program.send("stage rolled_back").startswith("staged ")
        assert program.send("rollback") == "ok"
        answer = program.send("bad")
        assert answer.startswith("error ") and "job_name must be a non-empty string" in answer, answer
    finally:
        program.close()
    stack.only_committed_delivered()


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
