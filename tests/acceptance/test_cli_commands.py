"""The ``drain`` command as a user runs it: a subprocess, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import psycopg
import pytest
import redis

from tests.support import configs, faultload, processes
from tests.support.waiting import wait_until

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_CHECK_FAILED = 0, 1, 2, 3
JOB = "tests.support.tasks.record"


def run(*args: str, dsn: str) -> subprocess.CompletedProcess[str]:
    done: subprocess.CompletedProcess[str] = processes.drain_cli(*args, dsn=dsn)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("drain:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture
def cfg(database: str, redis_db: str, tmp_path: Path) -> Path:
    return configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rq(redis_db, processes.ALLOWED_JOBS)}
    )


def test_stage_status_run_once_check(cfg: Path, database: str, redis_db: str) -> None:
    queue = f"cli-{uuid.uuid4().hex[:8]}"
    staged = run("stage", JOB, '["a@example.com", 1]', "--queue", queue, "--config", str(cfg), dsn=database)
    assert staged.returncode == EXIT_OK, staged.stderr
    job_id = uuid.UUID(staged.stdout.strip())
    deferred = run("stage", JOB, "--delay", "3600", "--queue", queue, "--config", str(cfg), dsn=database)
    assert deferred.returncode == EXIT_OK, deferred.stderr

    status = run("status", "--json", "--config", str(cfg), dsn=database)
    assert status.returncode == EXIT_OK, status.stderr
    figures = json.loads(status.stdout)
    assert (figures["backlog"], figures["due"], figures["future"], figures["dead"]) == (2, 1, 1, 0)
    assert figures["leader"] is None
    human = run("status", "--config", str(cfg), dsn=database)
    assert human.returncode == EXIT_OK and "backlog" in human.stdout

    check = run("check", "--config", str(cfg), dsn=database)
    assert check.returncode == EXIT_OK, check.stderr
    assert check.stdout.startswith("drain: ok")

    once = run("run", "--once", "--config", str(cfg), dsn=database)
    assert once.returncode == EXIT_OK, once.stderr
    assert "published 1," in once.stdout
    client = redis.Redis.from_url(redis_db)
    try:
        assert client.lrange(f"rq:queue:{queue}", 0, -1) == [str(job_id).encode()]
    finally:
        client.close()
    with psycopg.connect(database) as conn:
        (left,) = conn.execute("SELECT count(*) FROM staged_jobs").fetchone() or (0,)
    assert left == 1  # the deferred one


def test_migrate_is_idempotent_and_prints(cfg: Path, database: str) -> None:
    assert run("migrate", "--config", str(cfg), dsn=database).returncode == EXIT_OK
    printed = run("migrate", "--print", dsn=database)
    assert printed.returncode == EXIT_OK and "CREATE TABLE IF NOT EXISTS" in printed.stdout
    for function in ("drain_stage_v1", "drain_stage_v2"):
        assert f'CREATE OR REPLACE FUNCTION "public"."{function}"(' in printed.stdout


def test_invalid_args_json_is_one_line(cfg: Path, database: str) -> None:
    done = run("stage", JOB, "[not json", "--config", str(cfg), dsn=database)
    assert done.returncode == EXIT_USAGE
    assert "ARGS_JSON" in one_line_error(done)
    not_array = run("stage", JOB, '{"a": 1}', "--config", str(cfg), dsn=database)
    assert not_array.returncode == EXIT_USAGE
    assert "JSON array" in one_line_error(not_array)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--delay", "nan"], "delay must be"),
        (["--delay", "1e300"], "delay must be at most"),
        (["[" + "9" * 5000 + "]"], "ARGS_JSON is not valid JSON"),
    ],
)
def test_stage_refuses_what_python_cannot_hold_in_one_line(
    cfg: Path, database: str, args: list[str], said: str
) -> None:
    done = run("stage", JOB, *args, "--config", str(cfg), dsn=database)
    assert done.returncode == EXIT_USAGE
    assert said in one_line_error(done)


def test_stage_with_an_ordering_key(cfg: Path, database: str) -> None:
    key = "commande-é42"
    ids = []
    for marker in ("paid", "shipped"):
        done = run("stage", JOB, f'["{marker}"]', "--ordering-key", key, "--config", str(cfg), dsn=database)
        assert done.returncode == EXIT_OK, done.stderr
        ids.append(uuid.UUID(done.stdout.strip()))
    unkeyed = run("stage", JOB, "--config", str(cfg), dsn=database)
    assert unkeyed.returncode == EXIT_OK, unkeyed.stderr
    with psycopg.connect(database) as conn:
        rows = conn.execute("SELECT job_id, job_args, ordering_key FROM staged_jobs ORDER BY id").fetchall()
    assert rows == [
        (ids[0], ["paid"], key),
        (ids[1], ["shipped"], key),
        (uuid.UUID(unkeyed.stdout.strip()), [], None),
    ]


@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("", "ordering_key must not be empty or blank"),
        (" ", "ordering_key must not be empty or blank"),
        ("k" * 254 + "é", "ordering_key is 256 bytes; the limit is 255"),
        ("k" * 100_000, "ordering_key is 100000 bytes; the limit is 255"),
        ("order-\udcff", "ordering_key is not valid Unicode"),  # a byte of argv that is not UTF-8
    ],
)
def test_stage_refuses_a_bad_ordering_key_in_one_line(cfg: Path, database: str, key: str, said: str) -> None:
    done = run("stage", JOB, "--ordering-key", key, "--config", str(cfg), dsn=database)
    assert done.returncode == EXIT_USAGE
    line = one_line_error(done)
    assert said in line and len(line) < 200, line
    with psycopg.connect(database) as conn:
        assert conn.execute("SELECT count(*) FROM staged_jobs").fetchone() == (0,)


@pytest.mark.parametrize("command", [["stage", JOB], ["status"], ["dead", "list"], ["run", "--once"]])
def test_a_dsn_libpq_cannot_parse_is_one_line_without_its_password(
    cfg: Path, database: str, command: list[str]
) -> None:
    bad = "postgresql://bob:Sup3rS3cretPw@[::1/x"
    done = processes.drain_cli(*command, "--config", str(cfg), "--dsn", bad, dsn=database)
    assert done.returncode == EXIT_USAGE  # refused at load: a configuration mistake, not an outage
    assert "Sup3rS3cretPw" not in done.stdout + done.stderr
    assert "dsn: the connection string cannot be parsed" in one_line_error(done)


def test_bad_config_key_is_one_line(cfg: Path, database: str) -> None:
    cfg.write_text(cfg.read_text().replace("batch_size", "batchsize", 1))
    for command in (["run", "--once"], ["status"], ["stage", JOB], ["check"]):
        done = run(*command, "--config", str(cfg), dsn=database)
        assert done.returncode == EXIT_USAGE, (command, done.stderr)
        assert "batchsize: unknown key" in done.stderr
        assert all(line.startswith("drain:") for line in done.stderr.splitlines()), done.stderr


def test_missing_table_is_one_line(cfg: Path, database: str) -> None:
    cfg.write_text('table = "no_such_table"\n' + cfg.read_text())
    for command in (["run", "--once"], ["status", "--json"], ["stage", JOB]):
        done = run(*command, "--config", str(cfg), dsn=database)
        assert done.returncode == EXIT_FAILURE, (command, done.stderr)
        line = one_line_error(done)
        assert "no_such_table" in line and "drain migrate" in line, line
    checked = run("check", "--config", str(cfg), dsn=database)
    assert checked.returncode == EXIT_CHECK_FAILED
    assert "no_such_table" in checked.stderr


def test_check_reports_every_problem_at_once(cfg: Path, tmp_path: Path, database: str) -> None:
    bad = configs.write_config(
        tmp_path / "bad.toml",
        f"postgresql://postgres@127.0.0.1:{faultload.free_port()}/nowhere",
        {"default": configs.rq(f"redis://127.0.0.1:{faultload.free_port()}/0")},
    )
    done = run("check", "--config", str(bad), dsn=database)
    assert done.returncode == EXIT_CHECK_FAILED
    problems = [line for line in done.stderr.splitlines() if line.startswith("drain:")]
    assert any("database" in line for line in problems), done.stderr
    assert any("backend default" in line for line in problems), done.stderr


def test_missing_config_file_and_bad_flag(database: str, tmp_path: Path) -> None:
    missing = run("status", "--config", str(tmp_path / "absent.toml"), dsn=database)
    assert missing.returncode == EXIT_USAGE
    assert "does not exist" in one_line_error(missing)
    flag = run("run", "--no-such-flag", dsn=database)
    assert flag.returncode == EXIT_USAGE
    assert len(flag.stderr.strip().splitlines()) == 1


def test_status_names_the_leader_and_the_standbys(database: str, tmp_path: Path) -> None:
    """Each drain session is named ``drain/<version> <pid>@<host>``; status shows the leader's
    process, host, version and since when it leads, and the other drain as a standby."""
    import datetime
    import socket

    from drain import __version__

    config = configs.write_config(tmp_path / "drain.toml", database, {"default": configs.memory()})
    first = processes.start_drain(config, None, tmp_path / "first.log")
    second = processes.start_drain(config, None, tmp_path / "second.log")
    with processes.running(first, second):
        report: dict[str, object] = {}

        def both_seen() -> bool:
            nonlocal report
            report = json.loads(run("status", "--json", "--config", str(config), dsn=database).stdout)
            return report["leader"] is not None and len(report["standbys"]) == 1  # type: ignore[arg-type]

        wait_until("a leader and a standby in drain status", both_seen, 60)
        leader = report["leader"]
        assert isinstance(leader, dict)
        pids = {first.pid, second.pid}
        assert leader["process_id"] in pids and leader["host"] == socket.gethostname()[:40]
        assert leader["version"] == __version__
        since = datetime.datetime.fromisoformat(leader["since"])
        assert abs((datetime.datetime.now(datetime.UTC) - since).total_seconds()) < 120
        (standby,) = report["standbys"]  # type: ignore[misc]
        assert standby["process_id"] == (pids - {leader["process_id"]}).pop()
        human = run("status", "--config", str(config), dsn=database).stdout
        assert f"{leader['process_id']}@" in human and f"{standby['process_id']}@" in human, human


def test_dead_list_escapes_what_a_terminal_would_act_on(cfg: Path, database: str) -> None:
    """A row is the app's to fill: a job name, queue, backend, key or error holding ESC, CSI or a
    bidi override must not reach the operator's terminal as it is (it could retitle, recolour or
    rewrite the screen, or reorder what is shown)."""
    run("migrate", "--config", str(cfg), dsn=database)
    hostile = "\x1b]0;owned\x07\x1b[2J\x9b31m\u202eevil\t\r"
    with psycopg.connect(database) as conn:
        conn.execute(
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
            " options, created_at, attempts, error, ordering_key)"
            " VALUES (1, %s, '[]', '{}', %s, %s, gen_random_uuid(), '{}', now(), 1, %s, %s)",
            (f"app.{hostile}", f"q{hostile}", f"b{hostile}", f"boom{hostile}", f"k{hostile}"),
        )
    listed = run("dead", "list", "--config", str(cfg), dsn=database)
    assert listed.returncode == EXIT_OK, listed.stderr
    line = listed.stdout.rstrip("\n")
    assert "\n" not in line and line.count("\t") == 7, repr(line)
    for char in ("\x1b", "\x07", "\x9b", "\u202e", "\r"):
        assert char not in line, repr(line)
    assert "app.\\x1b]0;owned\\x07" in line and "\\u202eevil" in line
