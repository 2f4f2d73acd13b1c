"""The docs' examples cannot rot: every code block of the quickstart (README.md and
docs/getting-started.md), of docs/staging.md and of the backend pages is extracted from the Markdown
and run against the local services, each on a database, a Redis db index and queue names of its own.

A block that cannot run here is marked in the Markdown by the line before it,
``<!-- not-run: why -->``, and its case is skipped with that reason. Every other block must have a
runner below (by its language): a new kind of block fails until it gets one or a marker.

What the runners change in a block, and nothing else: the documented hosts and credentials become
the local services' (``rabbit.internal`` → 127.0.0.1 with guest/guest, ``redis://127.0.0.1:6379/0``
→ the test's db index, the quickstart's DSN → the test's database), queue names the test's own,
and ``.venv/bin/`` the test's virtualenv.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import psycopg
import pytest

from tests.conftest import AMQP_URL, missing, need_binary
from tests.support import docs, rabbit
from tests.support.waiting import wait_until

PAGES = (
    "getting-started.md",
    "staging.md",
    "backends/rq.md",
    "backends/rabbitmq.md",
    "backends/celery.md",
    "backends/dramatiq.md",
    "backends/ordering.md",
)
NOT_RUN = re.compile(r"<!-- not-run: (.+?) -->")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)
BIN = Path(sys.executable).parent
NODE_PG = docs.ROOT / "tests" / "stacks" / "node" / "node_modules" / "pg"
TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    number: int  # 1-based, in the page
    language: str
    code: str
    not_run: str | None  # the marker's reason

    @property
    def id(self) -> str:
        return f"{self.page}#{self.number}-{self.language or 'text'}"


def blocks(text: str, page: str) -> list[Block]:
    found = []
    for number, match in enumerate(FENCE.finditer(text), 1):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = NOT_RUN.fullmatch(before.strip())
        found.append(Block(page, number, match.group(1), match.group(2), marker[1] if marker else None))
    return found


def quickstart(text: str) -> str:
    return docs.section(text, "## Quickstart")


def all_blocks() -> list[Block]:
    found = blocks(quickstart(docs.page("getting-started.md")), "getting-started.md")
    for page in PAGES[1:]:
        found += blocks(docs.page(page), page)
    return found


def test_the_readme_quickstart_is_the_getting_started_one() -> None:
    """README.md's quickstart is the one the test runs: the same text, block for block."""
    readme = quickstart(docs.README.read_text())
    page = quickstart(docs.page("getting-started.md"))
    assert blocks(readme, "getting-started.md") == blocks(page, "getting-started.md")
    strip = re.compile(r"\[([^\]]+)\]\([^)]+\)")  # the links differ: docs/x.md from the README
    assert strip.sub(r"\1", readme).strip() == strip.sub(r"\1", page).strip()


def test_every_block_has_a_runner_or_a_reason() -> None:
    for block in all_blocks():
        assert block.not_run or runner(block) is not None, f"{block.id}: no runner and no not-run marker"


# --- substitutions -------------------------------------------------------------------------------


def local_services(code: str, redis_url: str) -> str:
    amqp = r"amqp://app:(\$\{RABBITMQ_PASSWORD\}|secret)@rabbit[\w.-]*(:5672)?"
    redis = r"redis://(:\$\{REDIS_PASSWORD\}@redis\.internal:6379|127\.0\.0\.1:6379)/0"
    return re.sub(redis, redis_url, re.sub(amqp, _amqp_base(), code))


def _amqp_base() -> str:
    parts = AMQP_URL.split("/")
    return "/".join(parts[:3])  # amqp://guest:guest@127.0.0.1:5672


def run(argv: list[str], *, env: dict[str, str] | None = None, cwd: Path = docs.ROOT) -> str:
    done = subprocess.run(
        argv,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def staged(dsn: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT job_name, queue FROM staged_jobs ORDER BY id")
        return [(name, queue) for name, queue in rows]


# --- the runners ---------------------------------------------------------------------------------


def run_quickstart(code: str, database: str, redis_db: str, tmp_path: Path) -> None:
    """Steps 2 to 7 as one shell script (step 7's ``kill %1`` is step 5's drain): the jobs
    staged from SQL and Python reach Redis and the RQ worker runs them."""
    need_binary("psql", "postgresql-client")
    script = code.replace("postgresql://postgres@127.0.0.1:5432/test", database)
    script = script.replace("redis://127.0.0.1:6379/0", redis_db).replace(".venv/bin/", f"{BIN}/")
    # examples/drain.toml as it is, but for the test's database and Redis db index.
    example = docs.ROOT / "examples" / "drain.toml"
    config = tmp_path / "drain.toml"
    config.write_text(local_services(example.read_text(), redis_db))
    assert "--config examples/drain.toml" in script
    script = script.replace("--config examples/drain.toml", f"--config {config}")
    # The test's own additions: a poll (with a deadline) for both jobs in Redis before the worker
    # starts, and the drain's exit status at the end.
    wait = (
        f'"{sys.executable}" -c "import redis,sys,time; r=redis.Redis.from_url(sys.argv[1]); '
        "d=time.monotonic()+60\nwhile r.llen('rq:queue:default') < 2:\n"
        " assert time.monotonic() < d, 'the drain did not forward both jobs'; time.sleep(0.05)\" "
        f"{redis_db}\n"
    )
    worker = script.index("PYTHONPATH=examples")
    script = script[:worker] + wait + script[worker:]
    script = "set -e\ntrap 'kill %1 2>/dev/null || true' EXIT\n" + script + "wait %1\necho drain exited $?\n"
    path = tmp_path / "quickstart.sh"
    path.write_text(script)
    output = run(["bash", str(path)])
    assert "sending a welcome email to a@example.com" in output, output
    assert "sending a welcome email to b@example.com" in output, output
    assert "drain exited 0" in output, output
    assert staged(database) == []


def run_toml(code: str, database: str, redis_db: str, tmp_path: Path) -> None:
    """A configuration: ``drain check`` loads it and reaches the database and every backend."""
    rabbit.need_rabbitmq()
    path = tmp_path / "drain.toml"
    path.write_text(local_services(code, redis_db))
    output = run(
        [str(BIN / "drain"), "check", "--config", str(path)],
        env={"DRAIN_DSN": database, "RABBITMQ_PASSWORD": "guest", "REDIS_PASSWORD": ""},
    )
    assert "ok" in output, output


def run_sql(code: str, database: str, redis_db: str, tmp_path: Path) -> None:
    """A statement: it runs on the test's database and stages what it says."""
    before = len(staged(database))
    with psycopg.connect(database) as conn:
        conn.execute(code.encode())
    assert len(staged(database)) == before + 1


PYTHON_PRELUDE = """
import asyncio, os, types
import psycopg, psycopg2, drain
import django
from django.conf import settings
from sqlalchemy import String, create_engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from hello import send_email, send_email as send_receipt

DSN = os.environ["DOC_DSN"]
conn = psycopg.connect(DSN)
pg2_conn = psycopg2.connect(DSN)
class Base(DeclarativeBase): pass
class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String)
engine = create_engine(DSN.replace("postgresql://", "postgresql+psycopg://"))
async_engine = create_async_engine(DSN.replace("postgresql://", "postgresql+psycopg://"))
Base.metadata.create_all(engine)
user, email, order = User(email="c@example.com"), "d@example.com", types.SimpleNamespace(pk=42)
_db = psycopg.conninfo.conninfo_to_dict(DSN)
_django = {"ENGINE": "django.db.backends.postgresql", "NAME": _db["dbname"], "USER": _db["user"],
           "HOST": _db["host"], "PORT": _db["port"]}
settings.configure(DATABASES={"default": _django, "orders": _django}, INSTALLED_APPS=["drain.contrib.django"])
django.setup()
from django.db import transaction
from drain.contrib import django as drain_django
"""
PYTHON_EPILOGUE = "\nconn.commit()\npg2_conn.commit()\n"


def run_python(code: str, database: str, redis_db: str, tmp_path: Path) -> None:
    """A staging call: run with the names it uses bound (PYTHON_PRELUDE), then committed; it
    stages at least one job."""
    if "handle(" in code:
        return run_consumer(code, database, tmp_path)
    if "await " in code:
        code = f"async def main():\n{textwrap.indent(code, '    ')}\nasyncio.run(main())\n"
    path = tmp_path / "example.py"
    path.write_text(PYTHON_PRELUDE + code + PYTHON_EPILOGUE)
    before = len(staged(database))
    run([sys.executable, str(path)], env={"DOC_DSN": database, "PYTHONPATH": f"{docs.ROOT / 'examples'}"})
    assert len(staged(database)) > before


def run_consumer(code: str, database: str, tmp_path: Path) -> None:
    """The RabbitMQ consumer: a message published to its queue is handled once and recorded."""
    rabbit.need_rabbitmq()
    queue = rabbit.unique_name("doc-emails")
    code = code.replace('"postgresql://app@db.internal/app"', repr(database))
    code = (
        local_services(code, "")
        .replace("@rabbit.internal/", "@127.0.0.1:5672/")
        .replace("amqp://app:secret", "amqp://guest:guest")
    )
    code = code.replace('"emails"', repr(queue))
    assert queue in code and database in code and "guest:guest@127.0.0.1" in code, code
    prelude = 'def handle(job_type, args, kwargs):\n    print("handled", job_type, args, flush=True)\n'
    path = tmp_path / "consumer.py"
    path.write_text(prelude + code)
    job_id = str(uuid.uuid4())
    with psycopg.connect(database) as conn:
        conn.execute("CREATE TABLE processed_jobs (job_id uuid PRIMARY KEY)")
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    try:
        channel = connection.channel()
        channel.queue_declare(queue, durable=True)
        body = b'{"job_id": "%s", "args": ["a@example.com"], "kwargs": {}}' % job_id.encode()
        properties = pika.BasicProperties(message_id=job_id, type="app.tasks.send_email")
        for _ in range(2):  # the same job twice: handled once
            channel.basic_publish("", queue, body, properties)
        consumer = subprocess.Popen(
            [sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:

            def taken() -> bool:
                assert consumer.poll() is None, consumer.communicate()[0]
                left = channel.queue_declare(queue, passive=True).method.message_count
                return not left and bool(processed(database))

            wait_until("the consumer to take both messages", taken, 60)
        finally:
            consumer.kill()
            output = consumer.communicate()[0]
        assert processed(database) == [job_id]
        assert output.count("handled app.tasks.send_email") == 1, output
    finally:
        rabbit.delete_queues(AMQP_URL, queue)
        connection.close()


def processed(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [str(row[0]) for row in conn.execute("SELECT job_id FROM processed_jobs")]


LANGUAGE_USERS = "CREATE TABLE users (email text)"


def run_js(code: str, database: str, redis_db: str, tmp_path: Path) -> None:
    node = need_binary("node", "nodejs")
    if not NODE_PG.exists():
        missing("tests/stacks/node/node_modules: run `npm ci --prefix tests/stacks/node` (.ci/run does)")
    program = (
        f"const {{ Client }} = require({str(NODE_PG)!r});\n(async () => {{\n"
        f"const client = new Client({{ connectionString: {database!r} }});\nawait client.connect();\n"
        f"const email = 'js@example.com';\n{code}await client.end();\n"
        "})().catch((error) => { console.error(error); process.exit(1); });\n"
    )
    run_language([node, "program.js"], "program.js", program, database, tmp_path)


def run_ruby(code: str, database: str, redis_db: str, tmp_path: Path) -> None:
    ruby = need_binary("ruby", "ruby-pg")
    program = f"require 'pg'\nrequire 'json'\nconn = PG.connect({database!r})\nemail = 'rb@example.com'\n"
    program += code
    run_language([ruby, "program.rb"], "program.rb", program, database, tmp_path)


def run_go(code: str, database: str, redis_db: str, tmp_path: Path) -> None:
    go = need_binary("go", "golang-go")
    if not Path("/usr/share/gocode/src/github.com/lib/pq").exists():
        missing("lib/pq is not installed (Debian package golang-github-lib-pq-dev)")
    program = (
        'package main\n\nimport (\n\t"context"\n\t"database/sql"\n\t"encoding/json"\n\n'
        '\t_ "github.com/lib/pq"\n)\n\nfunc main() {\n\tctx := context.Background()\n'
        f'\tdb, err := sql.Open("postgres", {_go_string(database + "?sslmode=disable")})\n'
        "\tif err != nil {\n\t\tpanic(err)\n\t}\n"
        '\temail := "go@example.com"\n\tencoded, _ := json.Marshal([]string{email})\n'
        "\targs := string(encoded)\n"
        f"{textwrap.indent(code, chr(9))}}}\n"
    )
    env = {"GOPATH": "/usr/share/gocode", "GO111MODULE": "off", "GOCACHE": str(tmp_path / "gocache")}
    run_language([go, "run", "main.go"], "main.go", program, database, tmp_path, env)


def _go_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def run_language(
    argv: list[str], name: str, program: str, database: str, tmp_path: Path, env: dict[str, str] | None = None
) -> None:
    """The fragment inside a program that connects to the test's database: its user and its job
    are committed together."""
    with psycopg.connect(database) as conn:
        conn.execute(LANGUAGE_USERS)
    (tmp_path / name).write_text(program)
    run(argv, cwd=tmp_path, env=env)
    with psycopg.connect(database) as conn:
        users = conn.execute("SELECT count(*) FROM users").fetchone()
    assert users == (1,)
    assert [name for name, _ in staged(database)] == ["app.tasks.send_welcome_email"]


RUNNERS = {
    "toml": run_toml,
    "sql": run_sql,
    "python": run_python,
    "js": run_js,
    "ruby": run_ruby,
    "go": run_go,
}


def runner(block: Block) -> object | None:
    if block.page == "getting-started.md" and block.language == "sh":
        return run_quickstart
    return RUNNERS.get(block.language)


def quickstart_script() -> Iterator[Block]:
    """The quickstart's runnable shell blocks, run as one script (a later step kills an earlier
    step's drain)."""
    for block in all_blocks():
        if block.page == "getting-started.md" and not block.not_run:
            yield block


def cases() -> list[object]:
    found: list[object] = []
    script = list(quickstart_script())
    found.append(pytest.param(script, id="quickstart"))
    for block in all_blocks():
        if block.page == "getting-started.md" and not block.not_run:
            continue
        found.append(pytest.param([block], id=block.id))
    return found


@pytest.mark.parametrize("chosen", cases())
def test_the_example_runs(chosen: list[Block], database: str, redis_db: str, tmp_path: Path) -> None:
    first = chosen[0]
    if first.not_run:
        pytest.skip(f"{first.id}: {first.not_run}")
    if len(chosen) > 1:
        assert {block.language for block in chosen} == {"sh"}
        run_quickstart("".join(block.code for block in chosen), database, redis_db, tmp_path)
        return
    found = runner(first)
    assert found is not None, f"{first.id}: no runner and no not-run marker"
    found(first.code, database, redis_db, tmp_path)  # type: ignore[operator]


def test_the_toolchains_the_runners_need_are_where_ci_puts_them() -> None:
    """.ci/run installs what the language runners use; this names it, so a runner that starts
    needing something else is noticed."""
    ci = (docs.ROOT / ".ci" / "run").read_text()
    for package in ("ruby-pg", "golang-go", "golang-github-lib-pq-dev", "nodejs", "npm"):
        assert package in ci
    assert shutil.which("bash")
