"""Hostile rows for the RQ backend at the head of the table never stop ``drain run`` (issue 10).

Rows a hostile or careless app can INSERT — options RQ refuses (``timeout`` 0, a ``ttl`` Redis's
EXPIRE would refuse inside the EXEC, ``1e400``), job names an RQ worker would resolve to something
nobody allowed (``tests.support.tasks.os.system``, ``tests.support.tasks.psycopg``, a builtin, a
dunder), a queue whose Redis key is not a list — sit before good rows. A real ``drain run`` keeps
running, real ``rq worker``s run every good row, and each bad row ends in the dead-letter table
with its own reason after ``max_attempts``. The drain's log has no traceback.
"""

from __future__ import annotations

import json
import uuid

import psycopg
import redis

import drain
from tests.support import configs, processes
from tests.support.rig import Rig
from tests.support.waiting import wait_until

GOOD = 20
MAX_ATTEMPTS = 2
RECORD = "tests.support.tasks.record"

# (job_name, options as JSON text, what the dead letter's error must say)
BAD_ROWS = [
    (RECORD, '{"timeout": 0}', "timeout must be between 1 and"),
    (RECORD, '{"timeout": 1e400}', "not a huge integer"),  # jsonb prints it as 401 digits
    (RECORD, '{"timeout": 1.5}', "timeout must be an integer number of seconds"),
    (RECORD, '{"timeout": 4294967296}', "timeout must be between 1 and"),
    (RECORD, '{"ttl": 100000000000000000000}', "ttl must be between 1 and"),
    (RECORD, '{"ttl": 0}', "ttl must be between 1 and"),
    (RECORD, '{"result_ttl": -2}', "result_ttl must be between 0 and"),
    (RECORD, '{"retry": {"max": 0}}', "RQ option retry must be"),
    (RECORD, '{"retry": {"max": 2, "interval": [-1]}}', "interval -1"),
    (RECORD, '{"at_front": "yes"}', "at_front must be true or false"),
    (RECORD, '{"meta": [1]}', "meta must be an object"),
    (RECORD, '{"description": 5}', "description must be a string"),
    (RECORD, '{"priority": 1}', "unknown RQ option(s) priority"),
    ("tests.support.tasks.os.system", "{}", "not in allowed_jobs"),
    ("tests.support.tasks.psycopg.connect", "{}", "not in allowed_jobs"),  # what the module imports
    ("print", "{}", "has no dot"),
    ("tests.support.tasks.__builtins__", "{}", "not a plain identifier"),
]


def test_refused_rows_are_dead_lettered_and_the_drain_keeps_running(rig: Rig) -> None:
    config = configs.write_config(
        rig.tmp / "hostile.toml",
        rig.dsn,
        {"default": configs.rq(rig.redis_url, [RECORD])},
        batch_size=10,
        max_attempts=MAX_ATTEMPTS,
        retry_max_s=0.1,
    )
    not_a_list = f"drain-test-string-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(rig.redis_url)
    client.set(f"rq:queue:{not_a_list}", "someone else's string")
    expected: dict[str, str] = {}
    with psycopg.connect(rig.dsn) as conn:
        for job_name, options, reason in BAD_ROWS:
            job_id = uuid.uuid4()
            conn.execute(
                "INSERT INTO staged_jobs (job_name, job_args, queue, job_id, options) "
                "VALUES (%s, '[1]', %s, %s, %s::jsonb)",
                (job_name, rig.queue, job_id, options),
            )
            expected[str(job_id)] = reason
        # The queue's fault, not the row's (issue 33): it waits, uncounted, never dead-lettered.
        wrong_queue = drain.stage(conn, RECORD, args=[0], queue=not_a_list)
        good = drain.stage_many(conn, [drain.Job(RECORD, args=[n], queue=rig.queue) for n in range(GOOD)])

    the_drain = processes.start_drain(config, rig.dsn, rig.tmp / "hostile-drain.log")
    with processes.running(the_drain):
        wait_until("every bad row dead-lettered", lambda: dead_count(rig.dsn) == len(expected), 90)
        wait_until("every good row run", lambda: delivered(rig.dsn) >= set(map(str, good)), 60)
        assert the_drain.alive(), the_drain.output()
        code = the_drain.terminate()
    log = the_drain.output()
    assert code == 0, log
    assert "Traceback" not in log, log

    with psycopg.connect(rig.dsn) as conn:
        dead = {
            str(job_id): (attempts, error)
            for job_id, attempts, error in conn.execute(
                "SELECT job_id, attempts, error FROM staged_jobs_dead"
            )
        }
        left = conn.execute("SELECT job_id, attempts, last_error FROM staged_jobs").fetchall()
    assert set(dead) == set(expected)
    for job_id, reason in expected.items():
        attempts, error = dead[job_id]
        assert attempts == MAX_ATTEMPTS
        assert reason in error, (reason, error)
        assert "\n" not in error
    assert [(job_id, attempts) for job_id, attempts, _ in left] == [(wrong_queue, 0)]
    assert "is a string, not an RQ queue list" in left[0][2]
    assert delivered(rig.dsn) == set(map(str, good))  # the bad rows never ran
    assert client.get(f"rq:queue:{not_a_list}") == b"someone else's string"  # left alone
    client.delete(f"rq:queue:{not_a_list}")
    client.close()


def dead_count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        (count,) = conn.execute("SELECT count(*) FROM staged_jobs_dead").fetchone() or (0,)
    return int(count)


def delivered(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        return {str(row[0]) for row in conn.execute("SELECT job_id FROM deliveries")}


def test_bad_rows_json_is_valid() -> None:
    for _, options, _ in BAD_ROWS:
        json.loads(options)
