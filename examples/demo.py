"""The main job end to end on the local services.

Signs up users in transactions that also stage a welcome-email job; every third transaction
rolls back. Then a real `drain run` forwards the committed jobs to Redis and a real `rq worker`
runs them. It prints what ran and checks it against what was committed.

Run it with `bash scripts/demo.sh` (which installs and starts what it needs).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import psycopg

import drain

ADMIN_DSN = os.environ.get("DEMO_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
DATABASE = os.environ.get("DEMO_DATABASE", "drain_demo")
REDIS_URL = os.environ.get("DEMO_REDIS_URL", "redis://127.0.0.1:6379/13")
QUEUE = os.environ.get("DEMO_QUEUE", "drain-demo")
USERS = 12
DEADLINE_S = 60
HERE = pathlib.Path(__file__).resolve().parent
BIN = pathlib.Path(sys.executable).parent


def make_database() -> str:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DATABASE}")
    dsn = ADMIN_DSN.rsplit("/", 1)[0] + f"/{DATABASE}"
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE users (id serial PRIMARY KEY, email text NOT NULL)")
        conn.execute(
            "CREATE TABLE demo_runs (job_id uuid, user_id int, email text, ran_at timestamptz DEFAULT now())"
        )
    return dsn


def sign_up(dsn: str) -> tuple[dict[str, str], dict[str, str]]:
    """Each signup inserts a user and stages its welcome email in ONE transaction."""
    committed: dict[str, str] = {}
    rolled_back: dict[str, str] = {}
    with psycopg.connect(dsn) as conn:
        for n in range(1, USERS + 1):
            email = f"user{n}@example.com"
            (user_id,) = conn.execute(
                "INSERT INTO users (email) VALUES (%s) RETURNING id", [email]
            ).fetchone()  # type: ignore[misc]
            job_id = drain.stage(conn, "tasks.send_welcome_email", args=[user_id, email], queue=QUEUE)
            if n % 3 == 0:
                conn.rollback()  # e.g. the payment failed: no user, and no email either
                rolled_back[str(job_id)] = email
            else:
                conn.commit()
                committed[str(job_id)] = email
    return committed, rolled_back


def main() -> int:
    dsn = make_database()
    subprocess.run([BIN / "drain", "migrate", "--dsn", dsn], check=True)
    committed, rolled_back = sign_up(dsn)
    print(f"staged {len(committed)} committed and {len(rolled_back)} rolled-back signups")
    subprocess.run([BIN / "drain", "status", "--dsn", dsn], check=True)

    config = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    config.write(
        f'dsn = "{dsn}"\n[backends.default]\ntype = "rq"\nurl = "{REDIS_URL}"\n'
        'allowed_jobs = ["tasks.send_welcome_email"]\n'
    )
    config.close()
    env = {**os.environ, "DEMO_DSN": dsn, "PYTHONPATH": str(HERE)}
    drain_process = subprocess.Popen([BIN / "drain", "run", "--config", config.name], env=env)
    worker = subprocess.Popen(
        [BIN / "rq", "worker", "--url", REDIS_URL, "--worker-class", "rq.worker.SimpleWorker", QUEUE],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    try:
        ran: dict[str, str] = {}
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and len(ran) < len(committed):
            with psycopg.connect(dsn) as conn:
                ran = {str(r[0]): r[1] for r in conn.execute("SELECT job_id, email FROM demo_runs")}
            time.sleep(0.2)
    finally:
        for process in (drain_process, worker):
            process.send_signal(signal.SIGTERM)
        for process in (drain_process, worker):
            process.wait(timeout=30)
        os.unlink(config.name)
        cleanup_redis(list(committed))

    print("\nwhat the rq worker ran:")
    for job_id, email in sorted(ran.items(), key=lambda item: item[1]):
        print(f"  {job_id}  send_welcome_email -> {email}")
    missing = set(committed) - set(ran)
    leaked = set(ran) & set(rolled_back)
    print(
        f"\ncommitted {len(committed)}, ran {len(ran)}, rolled back {len(rolled_back)}, "
        f"rolled back but ran {len(leaked)}, committed but not run {len(missing)}"
    )
    return 0 if not missing and not leaked else 1


def cleanup_redis(job_ids: list[str]) -> None:
    """Delete only what the demo created."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = [f"rq:job:{job_id}" for job_id in job_ids]
    keys += [f"rq:queue:{QUEUE}", f"rq:finished:{QUEUE}", f"rq:results:{QUEUE}"]
    client.delete(*keys)
    client.srem("rq:queues", f"rq:queue:{QUEUE}")
    client.close()


if __name__ == "__main__":
    sys.exit(main())
