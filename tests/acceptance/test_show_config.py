"""`drain check --show-config`, and a drain configured by environment variables alone.

No file: the database, an RQ backend and a core key come from ``DRAIN_*`` variables, a flag sets
another; the real ``drain`` command checks Postgres and Redis with them, prints each setting's
source with the password masked, and forwards a staged job to RQ.
"""

from __future__ import annotations

import json
import subprocess

import redis

from tests.support import processes

SECRET = "pw-4b1d7e"


def drain(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [processes.DRAIN, *args],
        check=False,
        env=env,
        cwd=processes.ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def env_only(database: str, redis_db: str) -> dict[str, str]:
    dsn = database.replace("postgresql://postgres@", f"postgresql://postgres:{SECRET}@")
    assert SECRET in dsn  # trust authentication ignores the password; the output must hide it
    return processes.environment(
        database,
        {
            "DRAIN_DSN": dsn,
            "DRAIN_BATCH_SIZE": "123",
            "DRAIN_BACKENDS__DEFAULT__TYPE": "rq",
            "DRAIN_BACKENDS__DEFAULT__URL": redis_db,
            "DRAIN_BACKENDS__DEFAULT__ALLOWED_JOBS": json.dumps(processes.ALLOWED_JOBS),
            "DRAIN_BACKENDS__DEFAULT__SOCKET_TIMEOUT_S": "2.5",
        },
    )


def test_show_config_with_a_backend_from_the_environment_alone(database: str, redis_db: str) -> None:
    done = drain(env_only(database, redis_db), "check", "--show-config", "--schema", "public")
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for expected in (
        f'dsn = "{database.replace("postgres@", "postgres:***@")}"  # env DRAIN_DSN',
        'schema = "public"  # flag --schema',
        'table = "staged_jobs"  # default',
        "batch_size = 123  # env DRAIN_BATCH_SIZE",
        "batch_max_bytes = 50331648  # default",
        'backends.default.type = "rq"  # env DRAIN_BACKENDS__DEFAULT__TYPE',
        f'backends.default.url = "{redis_db}"  # env DRAIN_BACKENDS__DEFAULT__URL',
        "backends.default.socket_timeout_s = 2.5  # env DRAIN_BACKENDS__DEFAULT__SOCKET_TIMEOUT_S",
        'metrics.listen = ""  # default: off',
    ):
        assert expected in lines, (expected, lines)
    assert lines[-1] == "drain: ok: database and 1 backend(s) reachable"


def test_a_drain_configured_by_the_environment_alone_forwards_to_rq(database: str, redis_db: str) -> None:
    env = env_only(database, redis_db)
    staged = drain(env, "stage", "tests.support.tasks.record", '["env-only"]', "--queue", "envcfg")
    assert staged.returncode == 0, staged.stderr
    job_id = staged.stdout.strip()
    done = drain(env, "run", "--once")
    assert done.returncode == 0, done.stderr
    assert "published 1," in done.stdout
    client = redis.Redis.from_url(redis_db)
    try:
        assert client.lrange("rq:queue:envcfg", 0, -1) == [job_id.encode()]
    finally:
        client.close()


def test_a_misspelt_variable_stops_the_command_with_one_line(database: str, redis_db: str) -> None:
    env = {**env_only(database, redis_db), "DRAIN_BACKENDS__DEFAULT__TYPE": "rq", "DRAIN_BATCH_SIZ": "5"}
    done = drain(env, "check", "--show-config")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        "drain: configuration: DRAIN_BATCH_SIZ: no setting has this variable "
        "(did you mean DRAIN_BATCH_SIZE?); unset it\n"
    )
