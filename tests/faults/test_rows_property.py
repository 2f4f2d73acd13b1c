"""Whatever a row holds, the drain survives it (issue 22, "Prove it"): a property at the SQL level.

Hypothesis generates rows as Postgres can hold them — any jsonb (nested thousands deep, wide,
numbers huge and tiny, long strings, every Unicode plane but NUL), any text (control characters,
megabytes), any timestamptz (±infinity, Postgres' extremes), options of any shape, and what AMQP
brokers close a channel or a connection on (headers over a frame, ``CC`` that is no array of
names, ``amq.`` and empty queues, TTLs out of range, Celery's ``expires`` at its edges), queue
names with CR or LF (which RabbitMQ strips from the names it declares) — and inserts
them with plain SQL into a table without its CHECK constraints (as an older schema made it, or
with constraints added NOT VALID) or through ``drain_stage_v1``, interleaved with good rows, for
four backends served by one long-lived ``drain run``: RQ, RabbitMQ, Celery on RabbitMQ and Celery
on Redis. ``batch_max_bytes`` is 4 MiB, so rows of megabytes meet the size cap too.

The invariant, for every example: each row was refused at INSERT, or is delivered exactly once, or
is dead-lettered with a reason, or is staged still because its run_at lies ahead; every good row is
delivered exactly once; the drain never exits, never steps down and logs no traceback.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pika.exceptions
import psycopg
import pytest
import redis
from drain_adapters.celery import queues as celery_queues
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support import configs, faultload, processes, rabbit
from tests.support.waiting import wait_until

RQ_JOB = "tests.support.faultload.noop"
CELERY_JOB = "tests.celery.noop"
BACKENDS = ("rq", "amqp", "celery_amqp", "celery_redis")
GOOD_NAME = {"rq": RQ_JOB, "amqp": "app.events.ok", "celery_amqp": CELERY_JOB, "celery_redis": CELERY_JOB}
STEP_DOWN_SIGNS = ("Traceback", "lost leadership", "database error")
REFUSED_AT_INSERT = (
    psycopg.errors.DataError,
    psycopg.errors.IntegrityError,
    psycopg.errors.ProgramLimitExceeded,
)
BIG_CHARS = 3_000_000  # past the 1 MiB row cap of a 4 MiB budget
MAX_EXAMPLES = 300

Sql = tuple[str, tuple[Any, ...]]  # an SQL expression for one value, and its parameters

# --- values --------------------------------------------------------------------------------------

ANY_CHAR = st.characters(codec="utf-8", exclude_characters="\x00")  # every plane; NUL is not text
TEXT = st.text(ANY_CHAR, max_size=12)
SCALAR_JSON = st.one_of(
    st.none().map(json.dumps),
    st.booleans().map(json.dumps),
    st.integers().map(str),
    st.integers(min_value=-(10**80), max_value=10**80).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.from_regex(r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,8})?[eE][+-]?[0-9]{1,3}", fullmatch=True),
    st.tuples(TEXT, st.booleans()).map(lambda pair: json.dumps(pair[0], ensure_ascii=pair[1])),
)
JSON_TEXT = st.recursive(
    SCALAR_JSON,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda items: "[" + ", ".join(items) + "]"),
        st.lists(st.tuples(TEXT, inner), max_size=4).map(
            lambda pairs: "{" + ",".join(f"{json.dumps(key)}: {value}" for key, value in pairs) + "}"
        ),
    ),
    max_leaves=10,
)


def literal(text: str, cast: str) -> Sql:
    return f"%s::{cast}", (text,)


def server_built(kind: str, size: int) -> Sql:
    """jsonb built by Postgres (faster than sending it): deep, wide, long or huge."""
    if kind == "deep":
        return "(repeat('[', %s) || repeat(']', %s))::jsonb", (size, size)
    if kind == "deep_object":
        return "(repeat('{\"a\": ', %s) || '0' || repeat('}', %s))::jsonb", (size, size)
    if kind == "wide":
        return "(SELECT jsonb_agg(g %% 7) FROM generate_series(1, %s) AS g)", (size,)
    if kind == "wide_empties":
        return "(SELECT jsonb_agg('[]'::jsonb) FROM generate_series(1, %s))", (size,)
    if kind == "long_string":
        return "jsonb_build_array(repeat('é\U0001f600x', %s))", (size,)
    if kind == "huge_integer":
        return "('[' || repeat('9', %s) || ']')::jsonb", (size,)
    assert kind == "tiny_number"
    return "('[0.' || repeat('0', %s) || '1]')::jsonb", (size,)


SERVER_JSON = st.one_of(
    st.builds(server_built, st.just("deep"), st.integers(60, 8_000)),
    st.builds(server_built, st.just("deep_object"), st.integers(60, 3_000)),
    st.builds(server_built, st.just("wide"), st.integers(1_000, 300_000)),
    st.builds(server_built, st.just("wide_empties"), st.integers(1_000, 300_000)),
    st.builds(server_built, st.just("long_string"), st.integers(1, BIG_CHARS // 3)),
    st.builds(server_built, st.just("huge_integer"), st.integers(300, 20_000)),
    st.builds(server_built, st.just("tiny_number"), st.integers(300, 16_000)),
)
ANY_JSONB = st.one_of(JSON_TEXT.map(lambda text: literal(text, "jsonb")), SERVER_JSON)
ARRAY = st.lists(JSON_TEXT, max_size=4).map(lambda items: literal("[" + ", ".join(items) + "]", "jsonb"))
OBJECT = st.lists(st.tuples(TEXT, JSON_TEXT), max_size=4).map(
    lambda pairs: literal("{" + ",".join(f"{json.dumps(k)}: {v}" for k, v in pairs) + "}", "jsonb")
)


def over_a_frame(key: str, size: int) -> Sql:
    """Options whose header frame passes frame_max (128 KiB): RabbitMQ closes the connection."""
    value = "repeat('x', %s)" if key == "shadow" else "jsonb_build_object('h', repeat('x', %s))"
    return f"jsonb_build_object(%s::text, {value})", (key, size)


# What AMQP brokers close a channel or a connection on, and Celery's time options at their edges.
BROKER_HOSTILE_OPTIONS = [
    {"headers": {"CC": 5}},
    {"headers": {"BCC": ["amq.gen-x"]}},
    {"headers": {"CC": ["", "q" * 300]}},
    {"expiration": 2**32},
    {"expires": 60 * 86_400},
    {"expires": 1e12},
    {"expires": -1},
    {"expires": "9999-12-31T23:59:59-14:00"},
    {"expires": "0001-01-01T00:00:00+14:00"},
    {"expires": "NaN"},
    {"retries": 2**70},
    {"time_limit": 1e308},
]
OPTION_OBJECTS = st.one_of(
    OBJECT,
    st.tuples(
        st.sampled_from(
            [
                *("timeout", "ttl", "priority", "expiration", "headers", "meta", "traceparent", "eta"),
                *("expires", "shadow", "retries", "time_limit"),
            ]
        ),
        JSON_TEXT,
    ).map(lambda pair: literal(json.dumps({pair[0]: None})[:-5] + pair[1] + "}", "jsonb")),
    st.sampled_from(BROKER_HOSTILE_OPTIONS).map(lambda options: literal(json.dumps(options), "jsonb")),
    st.builds(over_a_frame, st.sampled_from(["shadow", "headers"]), st.integers(100_000, 300_000)),
)
RESERVED_QUEUES = st.sampled_from(  # names no queue has; RabbitMQ strips CR and LF from those it declares
    ["", "amq.gen-x", "amq.rabbitmq.reply-to", "amq.direct", "q\nx", "drain-probe-\r", "\r\n"]
)
BIG_TEXT = st.integers(1_000, BIG_CHARS).map(lambda size: ("repeat(E'n\\x01\\n', %s)", (size // 3,)))
SPECIAL_TIMES = [
    "infinity",
    "-infinity",
    "4713-01-01 00:00:00+00 BC",
    "294276-12-31 23:59:59.999999+00",
    "0001-01-01 00:00:00+00",
    "0001-01-01 00:00:00+00 BC",
    "0001-01-03 12:00:00+14",
    "9999-12-31 23:59:59.999999+00",
    "10000-01-01 00:00:00+00",
    "1970-01-01 00:00:00+00",
]


@dataclasses.dataclass(frozen=True)
class Spec:
    """One row to insert: each column's SQL (None: the column's default), and how."""

    backend: str
    columns: dict[str, Sql]
    through_function: bool

    @property
    def future(self) -> bool:
        """Whether its run_at may lie ahead (then it may stay staged)."""
        return "run_at" in self.columns


PAST = st.datetimes(max_value=datetime.datetime(2020, 1, 1), timezones=st.just(datetime.UTC)).map(str)
FUTURE = st.datetimes(min_value=datetime.datetime(2200, 1, 1), timezones=st.just(datetime.UTC)).map(str)
TIMESTAMP = st.one_of(st.sampled_from(SPECIAL_TIMES), PAST, FUTURE)
ASPECTS = ("backend", "job_name", "queue", "job_args", "job_kwargs", "options", "run_at", "created_at")


@st.composite
def hostile(draw: st.DrawFn) -> Spec:
    """A row for one backend with odd but well-shaped content (Unicode everywhere, numbers of every
    size), and up to two of its columns hostile: any text, megabytes, any jsonb, any timestamp."""
    backend = draw(st.sampled_from(BACKENDS))
    through_function = draw(st.booleans())
    columns: dict[str, Sql] = {
        "backend": literal(backend, "text"),
        "job_name": literal(GOOD_NAME[backend], "text"),
        "job_args": draw(ARRAY),
    }
    if draw(st.booleans()):
        columns["job_kwargs"] = draw(OBJECT)
    any_text = TEXT.map(lambda text: literal(text, "text"))
    for aspect in draw(st.lists(st.sampled_from(ASPECTS), max_size=2, unique=True)):
        if aspect == "queue":
            reserved = RESERVED_QUEUES.map(lambda queue: literal(queue, "text"))
            columns[aspect] = draw(st.one_of(any_text, BIG_TEXT, reserved))
        elif aspect == "job_name":
            columns[aspect] = draw(st.one_of(any_text, BIG_TEXT))
        elif aspect == "backend":
            columns[aspect] = draw(any_text)
        elif aspect in ("job_args", "job_kwargs"):
            columns[aspect] = draw(st.one_of(ANY_JSONB, SERVER_JSON))
        elif aspect == "options":
            columns[aspect] = draw(st.one_of(OPTION_OBJECTS, ANY_JSONB, SERVER_JSON))
        elif aspect == "run_at" or not through_function:  # drain_stage_v1 takes no created_at
            columns[aspect] = literal(draw(TIMESTAMP), "timestamptz")
    return Spec(backend, columns, through_function)


def good_row(backend: str) -> Spec:
    columns = {"backend": literal(backend, "text"), "job_name": literal(GOOD_NAME[backend], "text")}
    return Spec(backend, {**columns, "job_args": literal('[1, "good"]', "jsonb")}, False)


# --- the rig ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Rig:
    dsn: str
    redis_url: str
    queues: dict[str, str]
    process: processes.Process
    delivered: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    elsewhere: set[str] = dataclasses.field(default_factory=set)
    """Queues other than the test's that AMQP rows named (Celery on AMQP declares each one, as
    send_task does; the RabbitMQ backend reaches any that exists): read and deleted by collect."""

    def insert(self, conn: psycopg.Connection[Any], spec: Spec) -> uuid.UUID | None:
        """Insert ``spec``'s row; None when Postgres (or drain_stage_v1) refused it."""
        columns = dict(spec.columns)
        columns.setdefault("queue", literal(self.queues[spec.backend], "text"))
        queue = columns["queue"][1][0] if columns["queue"][0] == "%s::text" else None
        if (
            spec.backend in ("amqp", "celery_amqp")
            and isinstance(queue, str)
            and queue not in self.queues.values()
        ):
            self.elsewhere.add(queue)
        names = list(columns)
        expressions = [columns[name][0] for name in names]
        params = tuple(value for name in names for value in columns[name][1])
        if spec.through_function:
            arguments = ", ".join(
                f"{name} => {expression}" for name, expression in zip(names, expressions, strict=True)
            )
            statement = f"SELECT drain_stage_v1({arguments})"
        else:
            statement = (
                f"INSERT INTO staged_jobs ({', '.join(names)}) "
                f"VALUES ({', '.join(expressions)}) RETURNING job_id"
            )
        try:
            row = conn.execute(statement, params).fetchone()
        except REFUSED_AT_INSERT:
            return None
        assert row is not None
        job_id: uuid.UUID = row[0]
        return job_id

    def collect(self) -> None:
        """Take every message the brokers hold now into ``delivered`` (job id -> copies)."""
        self.delivered.update(rabbit.take_counts(rabbit.SHARED_URL, (self.queues["amqp"],)))
        self.delivered.update(
            rabbit.take_counts(rabbit.SHARED_URL, (self.queues["celery_amqp"],), by="correlation_id")
        )
        self.delivered.update(take_and_delete(self.elsewhere))
        self.elsewhere.clear()
        client = redis.Redis.from_url(self.redis_url)
        try:
            for key in client.scan_iter(count=1000):
                if client.type(key) != b"list" or key.startswith(b"dramatiq:"):
                    continue  # not a queue of this test's backends (another test's Dramatiq keys)
                items = client.lrange(key, 0, -1)
                client.delete(key)
                for item in items:
                    if key.startswith(b"rq:queue:"):
                        self.delivered[item.decode()] += 1
                        client.delete(b"rq:job:" + item)
                    else:  # a Celery message on Redis: kombu's envelope
                        self.delivered[json.loads(item)["headers"]["id"]] += 1
        finally:
            client.close()


def take_and_delete(names: set[str]) -> collections.Counter[str]:
    """Job ids (``message_id``, or Celery's ``correlation_id``) of the messages in those of
    ``names`` that exist as queues; then delete them and their exchanges: they hold nothing but
    this test's rows (names drawn by Hypothesis, never another test's unique names)."""
    held: collections.Counter[str] = collections.Counter()
    connection = rabbit.connect(rabbit.SHARED_URL)
    try:
        for name in names:
            if not celery_queues.declarable(name):  # no queue has it: a passive declare would wait
                continue
            channel = connection.channel()
            try:
                channel.queue_declare(name, passive=True)
            except pika.exceptions.ChannelClosedByBroker:  # 404: no such queue
                continue
            while (got := channel.basic_get(name, auto_ack=True))[0] is not None:
                properties = got[1]
                held[str(properties.message_id or properties.correlation_id)] += 1
            channel.queue_delete(name)
            channel.exchange_delete(name)  # Celery declares a direct exchange beside the queue
            channel.close()
    finally:
        connection.close()
    return held


def drop_check_constraints(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for (name,) in conn.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = 'staged_jobs'::regclass AND contype = 'c'"
        ).fetchall():
            conn.execute(f'ALTER TABLE staged_jobs DROP CONSTRAINT "{name}"')


@pytest.fixture(scope="module")
def rig(
    module_database: str, module_redis_db: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Rig]:
    rabbit.need_rabbitmq()
    drop_check_constraints(module_database)
    tmp = tmp_path_factory.mktemp("rows-property")
    names = {backend: rabbit.unique_name(f"property-{backend.replace('_', '-')}") for backend in BACKENDS}
    with rabbit.queues(rabbit.SHARED_URL, names["amqp"], names["celery_amqp"]):
        config = configs.write_config(
            tmp / "drain.toml",
            module_database,
            {
                "rq": configs.rq(module_redis_db, [RQ_JOB]),
                "amqp": configs.rabbitmq(rabbit.SHARED_URL),
                "celery_amqp": {
                    "type": "celery",
                    "broker_url": rabbit.SHARED_URL,
                    "allowed_jobs": [CELERY_JOB],
                },
                "celery_redis": {
                    "type": "celery",
                    "broker_url": module_redis_db,
                    "allowed_jobs": [CELERY_JOB],
                },
            },
            max_attempts=2,
            batch_size=10,
            batch_max_bytes=4 << 20,
            retry_base_s=0.01,
            retry_max_s=0.05,
        )
        process = processes.start_drain(config, None, tmp / "drain.log")
        with processes.running(process):
            yield Rig(module_database, module_redis_db, names, process)


# --- the property -------------------------------------------------------------------------------------


@pytest.mark.slow
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(rows=st.lists(hostile(), min_size=1, max_size=3), order=st.randoms(use_true_random=False))
def test_every_row_ends_delivered_once_or_dead_lettered_and_the_drain_never_stops(
    rig: Rig, rows: list[Spec], order: Any
) -> None:
    log_from = len(rig.process.output())
    specs = [(spec, False) for spec in rows]
    specs += [(good_row(backend), True) for backend in BACKENDS]
    order.shuffle(specs)
    inserted: dict[uuid.UUID, tuple[Spec, bool]] = {}
    with psycopg.connect(rig.dsn, autocommit=True) as conn:
        for spec, good in specs:
            job_id = rig.insert(conn, spec)
            assert job_id is not None or not good, "a good row was refused"
            if job_id is not None:
                inserted[job_id] = (spec, good)
    ids = list(inserted)

    def settled() -> bool:
        assert rig.process.popen.poll() is None, rig.process.output()[-3000:]
        with psycopg.connect(rig.dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM staged_jobs WHERE job_id = ANY(%s) "
                "AND (run_at IS NULL OR run_at < now() + interval '10 seconds')",  # a retry comes sooner
                (ids,),
            ).fetchone()
        return row is not None and row[0] == 0

    wait_until("every due row to be delivered or dead-lettered", settled, faultload.DEADLINE_S)
    rig.collect()
    with psycopg.connect(rig.dsn, autocommit=True) as conn:
        dead = dict(
            conn.execute(
                "SELECT job_id, error FROM staged_jobs_dead WHERE job_id = ANY(%s)", (ids,)
            ).fetchall()
        )
        staged = {
            row[0] for row in conn.execute("SELECT job_id FROM staged_jobs WHERE job_id = ANY(%s)", (ids,))
        }
        waiting = {  # a queue no route leads to: the queue's fault, so its rows wait, uncounted
            row[0]
            for row in conn.execute(
                "SELECT job_id FROM staged_jobs WHERE job_id = ANY(%s) AND attempts = 0"
                " AND last_error LIKE '%%NO_ROUTE%%'",
                (ids,),
            )
        }
        conn.execute("DELETE FROM staged_jobs WHERE job_id = ANY(%s)", (list(staged),))  # rows due later
    log = rig.process.output()[log_from:]
    assert not [sign for sign in STEP_DOWN_SIGNS if sign in log], log[-5000:]
    event(f"refused at INSERT: {len(specs) - len(inserted)}")
    for job_id, (spec, good) in inserted.items():
        copies = rig.delivered[str(job_id)]
        if not good:
            event(
                "hostile row " + ("staged" if job_id in staged else "dead" if job_id in dead else "delivered")
            )
            if job_id in dead:
                event("dead: " + " ".join(dead[job_id].split("this row: ")[-1].split()[:4])[:50])
        if good:
            assert copies == 1 and job_id not in dead, (job_id, copies, dead.get(job_id))
        elif job_id in staged:
            assert (spec.future or job_id in waiting) and copies == 0, (spec, copies)
        elif job_id in dead:
            assert copies == 0 and dead[job_id].strip(), (spec, copies, dead[job_id])
        else:
            assert copies == 1, (spec, copies)
