"""Values Postgres stores and Python cannot read never stop a real ``drain run`` (issue 22).

JSON nested thousands of levels deep, numbers of thousands of digits, and timestamps outside
Python's ``datetime`` (±infinity, before year 1, after 9999) in ``created_at`` or ``run_at``, sit
among good rows in a table whose CHECK constraints were dropped (as in a table created before
they existed, or with constraints added NOT VALID and not yet validated), for an RQ and a
RabbitMQ backend served by one long-lived ``drain run``. For each situation: every good row is
delivered exactly once, each unreadable row is dead-lettered with its own reason, a row whose
``run_at`` is infinitely past is delivered and one infinitely far ahead stays staged; the drain
never exits, never steps down, and logs no traceback. Before the reader's fault boundary, the
first of these rows crashed the drain or made it step down on every step.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.support import configs, faultload, processes, rabbit
from tests.support.waiting import wait_until

GOOD_PER_CASE = 4  # per backend
JOB = "tests.support.faultload.noop"
STEP_DOWN_SIGNS = ("Traceback", "lost leadership", "database error")
DEEP = "(repeat('[', 5000) || repeat(']', 5000))::jsonb"


@dataclasses.dataclass(frozen=True)
class Row:
    """A hostile row: the column it sets, the SQL expression it sets it to, and what must become
    of it: dead-lettered with ``reason`` in the error, ``delivered``, or left ``staged``."""

    column: str
    expression: str
    reason: str = ""
    outcome: str = "dead"


CASES: dict[str, list[Row]] = {
    "deep_json": [
        Row("job_args", DEEP, "job_args is nested deeper than 64 levels"),
        Row(
            "job_kwargs",
            "('{\"a\": ' || repeat('{\"b\": ', 3000) || '1' || repeat('}', 3001))::jsonb",
            "job_kwargs",
        ),
        Row(
            "options",
            "('{\"meta\": ' || repeat('[', 100) || repeat(']', 100) || '}')::jsonb",
            "options is nested",
        ),
    ],
    "huge_numbers": [
        Row("job_args", "('[' || repeat('9', 5000) || ']')::jsonb", "integer of more than"),
        Row("job_kwargs", "('{\"n\": -' || repeat('7', 100000) || '}')::jsonb", "integer of more than"),
        Row("job_args", "('[' || repeat('9', 400) || '.5]')::jsonb", "too large for a float"),
    ],
    "created_at_out_of_range": [
        Row("created_at", "'infinity'", "created_at infinity is outside"),
        Row("created_at", "'-infinity'", "created_at -infinity is outside"),
        Row("created_at", "'0044-03-15 12:00:00+00 BC'", "created_at 0044-03-15"),
        Row("created_at", "'12000-01-01 00:00:00+00'", "created_at 12000-01-01"),
    ],
    "forged_ticks": [
        Row(
            "options",
            """'{"drain_schedule": 5, "drain_tick": "2026-01-01T03:00:00+00:00"}'""",
            "reserved for the ticks",
        ),
        Row("options", """'{"drain_tick": "2026-01-01T03:00:00+00:00"}'""", "reserved for the ticks"),
        Row(
            "options",
            """jsonb_build_object('drain_schedule', repeat('n', 100000), 'drain_tick', 'x')""",
            "reserved for the ticks",
        ),
    ],
    "run_at_out_of_range": [
        Row("run_at", "'-infinity'", outcome="delivered"),
        Row("run_at", "'4713-01-01 00:00:00+00 BC'", outcome="delivered"),
        Row("run_at", "'infinity'", outcome="staged"),
        Row("run_at", "'294276-12-31 23:59:59+00'", outcome="staged"),
    ],
}


@dataclasses.dataclass
class Drain:
    dsn: str
    redis_url: str
    rq_queue: str
    amqp_queue: str
    process: processes.Process
    amqp_seen: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def insert(self, conn: psycopg.Connection[Any], backend: str, column: str, expression: str) -> uuid.UUID:
        queue = self.rq_queue if backend == "work" else self.amqp_queue
        row = conn.execute(
            f"INSERT INTO staged_jobs (backend, job_name, queue, {column}) "
            f"VALUES (%s, %s, %s, {expression}) RETURNING job_id",
            (backend, JOB, queue),
        ).fetchone()
        assert row is not None
        job_id: uuid.UUID = row[0]
        return job_id

    def delivered(self, job_ids: set[uuid.UUID]) -> collections.Counter[uuid.UUID]:
        """How many times each of ``job_ids`` reached RQ or RabbitMQ so far."""
        self.amqp_seen.update(rabbit.take_counts(rabbit.SHARED_URL, (self.amqp_queue,)))
        counted: collections.Counter[uuid.UUID] = collections.Counter()
        counted.update(faultload.delivered(self.redis_url, [self.rq_queue]))
        counted.update({uuid.UUID(job_id): n for job_id, n in self.amqp_seen.items()})
        return collections.Counter({job_id: n for job_id, n in counted.items() if job_id in job_ids})


def drop_check_constraints(dsn: str) -> None:
    """The table as an older schema made it, or with constraints added NOT VALID: none checked."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        names = [
            row[0]
            for row in conn.execute(
                "SELECT conname FROM pg_constraint WHERE conrelid = 'staged_jobs'::regclass AND contype = 'c'"
            )
        ]
        for name in names:
            conn.execute(f'ALTER TABLE staged_jobs DROP CONSTRAINT "{name}"')


@pytest.fixture(scope="module")
def drain(
    module_database: str, module_redis_db: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Drain]:
    rabbit.need_rabbitmq()
    drop_check_constraints(module_database)
    tmp = tmp_path_factory.mktemp("unreadable")
    rq_queue = rabbit.unique_name("unreadable-rq")
    with rabbit.queues(rabbit.SHARED_URL, rabbit.unique_name("unreadable-amqp")) as (amqp_queue,):
        config = configs.write_config(
            tmp / "drain.toml",
            module_database,
            {
                "work": configs.rq(module_redis_db, [JOB]),
                "events": configs.rabbitmq(rabbit.SHARED_URL),
            },
            max_attempts=2,
            batch_size=10,
            retry_base_s=0.01,
            retry_max_s=0.05,
        )
        process = processes.start_drain(config, None, tmp / "drain.log")
        with processes.running(process):
            yield Drain(module_database, module_redis_db, rq_queue, amqp_queue, process)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_rows_python_cannot_hold_are_dead_lettered_and_the_good_ones_flow(drain: Drain, case: str) -> None:
    log_from = len(drain.process.output())
    hostile: dict[uuid.UUID, Row] = {}
    good: list[uuid.UUID] = []
    with psycopg.connect(drain.dsn, autocommit=True) as conn:
        for backend in ("work", "events"):
            for number in range(GOOD_PER_CASE):
                good.append(drain.insert(conn, backend, "job_args", f"'[{number}]'"))
                if number < len(CASES[case]):
                    row = CASES[case][number]
                    hostile[drain.insert(conn, backend, row.column, row.expression)] = row
    leaving = set(good) | {job_id for job_id, row in hostile.items() if row.outcome != "staged"}

    def settled() -> bool:
        assert drain.process.popen.poll() is None, drain.process.output()[log_from:][-3000:]
        with psycopg.connect(drain.dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM staged_jobs WHERE job_id = ANY(%s)", (list(leaving),)
            ).fetchone()
        return row is not None and row[0] == 0

    wait_until(f"the {case} rows to be delivered or dead-lettered", settled, faultload.DEADLINE_S)
    with psycopg.connect(drain.dsn) as conn:
        dead = dict(
            conn.execute(
                "SELECT job_id, error FROM staged_jobs_dead WHERE job_id = ANY(%s)", (list(hostile),)
            ).fetchall()
        )
        staged = {row[0] for row in conn.execute("SELECT job_id FROM staged_jobs")}
    delivered = drain.delivered(set(good) | set(hostile))
    log = drain.process.output()[log_from:]

    assert drain.process.popen.poll() is None, log[-3000:]
    assert not [sign for sign in STEP_DOWN_SIGNS if sign in log], log[-3000:]
    assert {job_id: delivered[job_id] for job_id in good} == dict.fromkeys(good, 1)
    for job_id, row in hostile.items():
        if row.outcome == "dead":
            assert job_id in dead and row.reason in dead[job_id], (row, dead.get(job_id))
            assert job_id not in delivered, row
        elif row.outcome == "delivered":
            assert delivered[job_id] == 1 and job_id not in dead, row
        else:
            assert job_id in staged and job_id not in delivered, row


@pytest.mark.slow
def test_drain_stage_v1_either_refuses_an_infinite_run_at_or_the_row_is_delivered(drain: Drain) -> None:
    """Through the SQL function: refused at INSERT (22023, once the schema checks it) or read."""
    with psycopg.connect(drain.dsn, autocommit=True) as conn:
        try:
            row = conn.execute(
                "SELECT drain_stage_v1(job_name => %s, queue => %s, backend => 'work', "
                "run_at => '-infinity')",
                (JOB, drain.rq_queue),
            ).fetchone()
        except psycopg.errors.InvalidParameterValue:
            return  # refused at INSERT: a legitimate outcome
    assert row is not None
    job_id = row[0]
    wait_until("the row delivered", lambda: drain.delivered({job_id})[job_id] == 1, faultload.DEADLINE_S)
    assert drain.process.popen.poll() is None


@pytest.mark.slow
def test_drain_dead_list_shows_the_rows_python_cannot_hold(drain: Drain) -> None:
    """Dead-lettered for what they hold, they are listed with it (as text where Python cannot
    hold it), in plain lines and in JSON: the command never fails on a dead letter."""
    with psycopg.connect(drain.dsn, autocommit=True) as conn:
        dying = [
            drain.insert(conn, "work", column, expression)
            for column, expression in (
                ("job_args", DEEP),
                ("job_kwargs", "('{\"n\": ' || repeat('7', 5000) || '}')::jsonb"),
                ("created_at", "'-infinity'"),
            )
        ]

    def dead() -> bool:
        query = "SELECT count(*) FROM staged_jobs_dead WHERE job_id = ANY(%s)"
        return bool(faultload.scalar(drain.dsn, query, (dying,)) == len(dying))

    wait_until("the rows dead-lettered", dead, faultload.DEADLINE_S)
    listed = processes.drain_cli("dead", "list", "--config", str(drain.process.config), dsn=drain.dsn)
    as_json = processes.drain_cli(
        "dead", "list", "--json", "--config", str(drain.process.config), dsn=drain.dsn
    )
    assert listed.returncode == 0 and as_json.returncode == 0, listed.stderr + as_json.stderr
    letters = json.loads(as_json.stdout)
    assert len(letters) == len(listed.stdout.splitlines()) >= 3
    assert "-infinity" in {letter["created_at"] for letter in letters}
    assert any(str(letter["args"]).startswith("[[[[") for letter in letters)  # its text
