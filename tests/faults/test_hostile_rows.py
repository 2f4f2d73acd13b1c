"""Hostile rows at the head of the table never stop the drain (issue 10; SPEC §7 "Every backend").

Whoever can INSERT into ``staged_jobs`` writes rows with plain SQL, past every check of
``drain.stage()``. Rows of every kind that broke the drain before — an option RQ refuses (which
crashed the drain on every restart), names and headers AMQP cannot encode (which wedged for ever
as "broker unavailable"), a name outside ``allowed_jobs`` through an attribute chain — sit
before good rows for an RQ and a RabbitMQ backend served by one real ``drain run``. Every good
row is delivered (read back from Redis and from a real queue), every hostile row ends in
``staged_jobs_dead`` with its reason, the drain is still running, and its log has no traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from tests.support import configs, faultload, ledger, processes, rabbit

GOOD = 20
JOB = "tests.support.faultload.noop"

# (backend, job_name, queue, args, options) — queue None: the backend's good queue
HOSTILE_RQ = [
    (JOB, [], {"timeout": 0}),
    (JOB, [], {"timeout": -5}),
    (JOB, [], {"ttl": 10**30}),
    (JOB, [], {"result_ttl": 10**30}),
    (JOB, [], {"retry": {"max": 0}}),
    (JOB, [], {"retry": {"max": 2, "interval": [-1]}}),
    (JOB, [], {"at_front": "yes"}),
    (JOB, [], {"meta": "not an object"}),
    (JOB, [], {"description": 5}),
    (JOB, [], {"no_such_option": 1}),
    ("tests.support.faultload.os.system", ["echo pwned"], {}),  # an attribute chain past the list
    ("eval", ["1"], {}),  # a builtin
]
HOSTILE_RABBITMQ = [
    ("x" * 300, [], {}),  # the AMQP `type` short string
    ("app.events.big_header", [], {"headers": {"n": 2**70}}),  # beyond a signed 64-bit int
    ("app.events.long_key", [], {"headers": {"k" * 300: 1}}),
    ("app.events.priority", [], {"priority": 300}),
    ("app.events.expiration", [], {"expiration": -1}),
]


@pytest.mark.slow
def test_hostile_rows_are_dead_lettered_and_the_good_ones_flow(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    rabbit.need_rabbitmq()
    faultload.prepare(database)
    rq_queue = rabbit.unique_name("hostile-rq")
    with rabbit.queues(rabbit.SHARED_URL, rabbit.unique_name("hostile-amqp")) as (amqp_queue,):
        rows: list[tuple[str, str, str, str, str]] = []
        rows += [
            ("work", name, rq_queue, json.dumps(args), json.dumps(opts)) for name, args, opts in HOSTILE_RQ
        ]
        rows += [
            ("events", name, amqp_queue, json.dumps(args), json.dumps(opts))
            for name, args, opts in HOSTILE_RABBITMQ
        ]
        rows.append(("events", "app.events.long_queue", "q" * 300, "[]", "{}"))  # the routing key
        rows.append(("nowhere", JOB, rq_queue, "[]", "{}"))  # no such backend
        with psycopg.connect(database) as conn:
            hostile = [
                conn.execute(
                    "INSERT INTO staged_jobs (backend, job_name, queue, job_args, options) "
                    "VALUES (%s, %s, %s, %s::jsonb, %s::jsonb) RETURNING job_id",
                    row,
                ).fetchone()[0]  # type: ignore[index]
                for row in rows
            ]
            good = [
                conn.execute(
                    "INSERT INTO staged_jobs (backend, job_name, queue, job_args) "
                    "VALUES (%s, %s, %s, %s::jsonb) RETURNING job_id",
                    (backend, JOB if backend == "work" else "app.events.ok", queue, json.dumps([n])),
                ).fetchone()[0]  # type: ignore[index]
                for backend, queue in (("work", rq_queue), ("events", amqp_queue))
                for n in range(GOOD)
            ]
        config = configs.write_config(
            tmp_path / "drain.toml",
            database,
            {
                "work": configs.rq(redis_db, [JOB], max_attempts=2),
                "events": configs.rabbitmq(rabbit.SHARED_URL, max_attempts=2),
            },
            max_attempts=2,
            batch_size=10,
            retry_base_s=0.01,
            retry_max_s=0.05,
        )
        drain = processes.start_drain(config, None, tmp_path / "drain.log")
        with processes.running(drain):
            ledger.wait_drained(database)
            assert drain.popen.poll() is None, drain.output()  # still running
            taken = rabbit.take_all(rabbit.SHARED_URL, amqp_queue)
        log = drain.output()
    assert "Traceback" not in log, log[-3000:]
    in_redis = faultload.delivered(redis_db, [rq_queue])
    duplicates = sum(count - 1 for count in in_redis.values())
    delivered = {str(job_id) for job_id in in_redis} | set(taken)
    by_id = {str(job_id): row for job_id, row in zip(hostile, rows, strict=True)}
    forwarded = [by_id[job_id] for job_id in delivered if job_id in by_id]
    assert forwarded == [], f"hostile rows forwarded: {forwarded}"
    assert delivered == {str(job_id) for job_id in good} and duplicates == 0
    with psycopg.connect(database) as conn:
        dead = dict(conn.execute("SELECT job_id, error FROM staged_jobs_dead").fetchall())
    assert set(dead) == set(hostile)
    assert all(str(error).strip() for error in dead.values())
