"""Red team 35 on the speed levers: Celery's AMQP frames built once a batch (e7ddd64, ec6248b,
3cf2607), RQ's per-row CPU cuts (ba25d21, b004131, 2ff422c, 60dbc65, d79c370) and the DELETE
wake-up trigger ``drain_wake_freed`` (c246ea2).

Findings, each fixed since (its test passes; it failed before the fix):

- A batch whose bytes the link cannot carry within what is left of the call is lost whole
  (``_flush`` raises ``batch_lost``): through a 2 MB/s link with ``publish_timeout_s = 2``, a batch
  of 60 rows of 200 KB is an outage on every attempt (0 published; before e7ddd64, 40 of 60 were
  published each attempt), while the head of the batch reaches the queue each time (duplicates on
  every retry). Five of the same rows alone go in 0.6 s.
  Through the relay (same link, 60 rows of 200 KB): none of the 60 rows forwarded in 30 s, the
  queue got 111 messages for 19 rows (up to 6 copies of one); at e7ddd64^ all 60 in 8 s (61
  messages). With the defaults (batch_max_bytes 48 MiB, publish_timeout_s 10) a link below about
  5 MB/s stalls a backlog of large rows the same way. Fix (opinion): end the chunks on message
  boundaries and check the deadline between them; when it has passed, leave the unwritten tail
  unsent (RETRY, uncounted, its delivery tags given back) instead of dropping the batch; only a
  write cut inside a chunk must drop the connection. A relay halving the batch after such an
  outage would do as a net.
  Fixed since (both tests pass, marks removed): whole messages a chunk, the writes stop at half
  of what was left when they began, the messages not written RETRY uncounted: 18-19 of 60
  published a call; the relay forwards all 60 in 8-9 s (62-63 messages in the queue).
- The drain's own settlement of rows an app deleted meanwhile (a settlement written after the
  batch, in a fresh transaction) fires ``drain_wake_freed``: ``set_config('drain.settling')`` sits
  in a USING subquery the plan evaluates only once a row joins, so with no row left to delete the
  setting is never set, the trigger probes the wake slots and notifies the sleepers (a spurious
  step for each sleeping member; the slots held shared until that transaction ends). Low cost,
  but the commit's stated intent. Fix (opinion): make it a one-time filter, ``WHERE (SELECT
  set_config('drain.settling', 'on', true)) = 'on' AND ...``: PostgreSQL evaluates it before
  reading any row (checked: set for gone rows and for empty arrays).
  Fixed as suggested.
- The upgrade adds ``drain_wake_freed`` enabled on origin only, beside ``drain_wake`` and
  ``drain_wake_due`` an operator set ENABLE ALWAYS (which the slot upgrade takes care to keep): a
  DELETE under ``session_replication_role = replica`` (a subscriber's apply) wakes nobody while
  the INSERT does. Fix (opinion): create it with drain_wake's enable state (as the slot upgrade
  keeps each one's); ``drain check`` looks at drain_wake only, so it says nothing of this.
  Fixed as suggested (``drain check`` still looks at drain_wake only).

Held (pass): a header frame of exactly ``frame_max`` bytes is published, one byte more is that
row's rejection alone; a queue at max-length with ``reject-publish`` nacks: its rows RETRY, none
rejected; the properties encoder agrees with py-amqp's on odd values (keys of 255/256 bytes, the
int32/int64 edges, bytes, tuples, surrogates, Decimal, datetime, NaN); an app's DELETE wakes the
sleeper, its own ``SET drain.settling = on`` silences only its own session; a cascaded DELETE from
20,000 parent rows fires the statement trigger once (no per-row cost; 20,000 one-row DELETE
statements in a loop: 5.0-5.6 us each with the trigger, 3.6-4.0 without; a 100k-row DELETE
0.05 s either way); non-finite numbers (a
jsonb ``1e400``) never reach the Celery adapter (the reader refuses the row); an unprivileged
app's DELETE and a SECURITY DEFINER function's wake the sleeper; RQ's hash for any JSON args,
kwargs and options (hypothesis, 60 examples, both serializers) is enqueue_many's field by field;
100 MB of mandatory returns (a queue deleted under a batch of 200 rows of 500 KB) read back after
the write without a stall; a link reset while a 4 MB batch goes through it (a frame cut in
half at the broker): only the rows the broker confirmed are PUBLISHED (4 of 20, each in the
queue), none rejected, the next batch goes on a new connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import decimal
import socket
import threading
import time
import uuid
import zlib
from typing import Any

import amqp
import psycopg
import pytest
import redis
import rq
from drain_adapters import celery as celery_backend
from drain_adapters import rq as rq_adapter
from drain_adapters.celery import amqp_properties
from drain_adapters.celery import amqp_publisher as celery_amqp
from drain_adapters.celery import message as celery_message
from drain_adapters.rq import message as rq_message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq import serializers

import drain
from drain import config, models
from drain.store import reading, sql
from drain.store import session as store
from tests.support import rabbit, roles

WAKE_KEY = "SELECT hashtextextended('drain-wake:public.staged_jobs', 0)"
WAKE_CHANNEL = "SELECT 'drain_wake_' || to_hex(hashtextextended('drain-wake:public.staged_jobs', 0))"


def row(queue: str, row_id: int, **changes: Any) -> models.StagedJob:
    fields: dict[str, Any] = {
        "id": row_id,
        "job_id": uuid.uuid4(),
        "job_name": "app.tasks.send",
        "args": [1],
        "kwargs": {},
        "queue": queue,
        "backend": "default",
        "options": {},
        "created_at": datetime.datetime.now(datetime.UTC),
        **changes,
    }
    return models.StagedJob(**fields)


def adapter(url: str = rabbit.SHARED_URL, publish_timeout_s: float = 5) -> celery_backend.CeleryAdapter:
    return celery_backend.CeleryAdapter.from_options(
        "levers", {"broker_url": url, "allowed_jobs": ["app.**"]}, publish_timeout_s=publish_timeout_s
    )


class Throttle:
    """A TCP proxy forwarding the client's bytes at most ``rate`` bytes a second (a slow uplink;
    the server's replies go at once). Its accepted sockets have a small receive buffer."""

    def __init__(self, target_port: int, rate: float) -> None:
        self.rate = rate
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        """Reset every connection through it (RST); new ones are still accepted."""
        sockets, self.sockets = self.sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                sock.close()

    def close(self) -> None:
        for sock in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, slow: bool) -> None:
        try:
            while data := source.recv(16384 if slow else 65536):
                target.sendall(data)
                if slow:
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        for sock in (source, target):
            with contextlib.suppress(OSError):
                sock.close()


# --- Findings -----------------------------------------------------------------------------------


def test_a_batch_larger_than_the_link_carries_in_the_timeout_still_makes_progress() -> None:
    rabbit.need_rabbitmq()
    throttle = Throttle(5672, rate=2_000_000)
    (queue,) = names = (rabbit.unique_name("r35-slow"),)
    published = 0
    attempts: list[str] = []
    try:
        with rabbit.queues(rabbit.SHARED_URL, *names):
            celery = adapter(f"amqp://guest:guest@127.0.0.1:{throttle.port}//", publish_timeout_s=2)
            celery.open()
            try:
                batch = [row(queue, n, args=["x" * 200_000]) for n in range(1, 61)]
                for _attempt in range(2):  # the relay retries the same rows after its pause
                    try:
                        results = celery.publish_batch(batch)
                    except drain.BackendUnavailable:
                        attempts.append("an outage")
                        continue
                    outcomes = [r.outcome for r in results]
                    published += outcomes.count(models.Outcome.PUBLISHED)
                    attempts.append(
                        f"{outcomes.count(models.Outcome.PUBLISHED)} published, "
                        f"{outcomes.count(models.Outcome.RETRY)} retry"
                    )
                alone = celery.publish_batch(batch[:5])  # the same rows, a few at a time, go
                assert [r.outcome for r in alone] == [models.Outcome.PUBLISHED] * 5
            finally:
                celery.close()
            held = rabbit.take_counts(rabbit.SHARED_URL, names, by="correlation_id")
    finally:
        throttle.close()
    print(
        f"attempts of 60 rows: {attempts}; the queue got {sum(held.values())} messages for {len(held)} rows"
    )
    assert published > 0, "every attempt of the batch was an outage: its rows never leave"


def notifications(
    dsn: str, statement: str, params: dict[str, Any] | None = None, *, rollback: bool = False
) -> int:
    """How many wake-ups a sleeping leader (holding the wake lock, LISTENing) gets when
    ``statement`` commits on a connection of its own."""
    with psycopg.connect(dsn, autocommit=True) as sleeper, psycopg.connect(dsn, autocommit=True) as listener:
        key = sleeper.execute(WAKE_KEY).fetchone()[0]  # type: ignore[index]
        sleeper.execute("SELECT pg_advisory_lock(%s)", (key,))
        channel = listener.execute(WAKE_CHANNEL).fetchone()[0]  # type: ignore[index]
        listener.execute(f'LISTEN "{channel}"')
        with psycopg.connect(dsn) as app:
            for part in statement.split(";\n"):
                app.execute(part, params)
            if rollback:
                app.rollback()
            else:
                app.commit()
        return len(list(listener.notifies(timeout=1.0, stop_after=1)))


def test_the_drains_settlement_of_rows_an_app_deleted_meanwhile_does_not_wake(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO staged_jobs (job_name) SELECT 'app.x' FROM generate_series(1, 1000)")
        conn.execute("ANALYZE staged_jobs")
        taken = conn.execute("SELECT id, job_id FROM staged_jobs ORDER BY id LIMIT 100").fetchall()
        conn.execute("DELETE FROM staged_jobs WHERE id <= %s", (taken[-1][0],))  # an app's cancel
    delete_ids = sql.query("delete_ids", sql.Names("public", "staged_jobs")).as_string(None)
    params = {"ids": [r[0] for r in taken], "job_ids": [r[1] for r in taken]}
    assert notifications(database, delete_ids, params) == 0


# --- Held ---------------------------------------------------------------------------------------


def test_held_a_header_frame_of_frame_max_goes_one_byte_more_is_its_own_rejection() -> None:
    rabbit.need_rabbitmq()
    (queue,) = names = (rabbit.unique_name("r35-hdr"),)
    with rabbit.queues(rabbit.SHARED_URL, *names):
        celery = adapter()
        celery.open()
        try:
            app = celery_message.new_app()
            base = celery_message.build(
                app,
                row(queue, 1, options={"headers": {"pad": ""}}),
                reply_to=str(uuid.uuid4()),
                now=datetime.datetime.now(datetime.UTC),
            )
            empty = celery_amqp.wire(base)[1].header_frame_bytes
            frame_max = 131072  # RabbitMQ's default, as py-amqp tunes it
            outcomes = {}
            for over in (0, 1):
                pad = "x" * (frame_max + over - empty)
                batch = [row(queue, 1), row(queue, 2, options={"headers": {"pad": pad}}), row(queue, 3)]
                results = celery.publish_batch(batch)
                outcomes[over] = {r.row_id: r.outcome for r in results}
        finally:
            celery.close()
    published, rejected = models.Outcome.PUBLISHED, models.Outcome.REJECTED
    assert outcomes[0] == {1: published, 2: published, 3: published}
    assert outcomes[1] == {1: published, 2: rejected, 3: published}


def test_held_a_queue_at_max_length_rejecting_publishes_makes_its_rows_wait() -> None:
    rabbit.need_rabbitmq()
    (queue,) = names = (rabbit.unique_name("r35-full"),)
    arguments = {"x-max-length": 2, "x-overflow": "reject-publish"}
    with rabbit.queues(rabbit.SHARED_URL, *names, arguments=arguments):
        celery = adapter()
        celery.open()
        try:
            results = celery.publish_batch([row(queue, n) for n in range(1, 7)])
        finally:
            celery.close()
    outcomes = sorted(r.outcome.value for r in results)
    assert outcomes.count(models.Outcome.PUBLISHED.value) == 2
    assert outcomes.count(models.Outcome.RETRY.value) == 4


ODD_VALUES: list[Any] = [
    "é\u2028\U0001f600",
    "\ud800",  # a lone surrogate: py-amqp's surrogatepass
    b"\x00\xff",
    2147483647,
    -2147483647,
    2147483648,
    -2147483648,
    2**63 - 1,
    -(2**63),
    2**63,
    True,
    None,
    1.5,
    float("nan"),
    float("inf"),
    decimal.Decimal("1.25"),
    datetime.datetime(2026, 1, 1),
    (1, "a", None),
    [[[]]],
    {},
    {"n": {"m": [1, {"k": None}]}},
    "x" * 70_000,
]


@pytest.mark.parametrize(
    "value", ODD_VALUES, ids=[type(v).__name__ + str(i) for i, v in enumerate(ODD_VALUES)]
)
@pytest.mark.parametrize("key", ["k", "é" * 127, "k" * 255, "k" * 256, b"bytes-key"])
def test_held_the_properties_encoder_is_py_amqps(key: Any, value: Any) -> None:
    properties = {"correlation_id": "c", "priority": 0, "application_headers": {key: value, "z": None}}
    message = amqp.Message(b"", **properties)

    def theirs() -> bytes:
        return bytes(amqp.Message._serialize_properties(message))

    try:
        want: bytes | type[BaseException] = theirs()
    except Exception as exc:  # py-amqp refuses: the encoder must refuse alike
        want = type(exc)
    if isinstance(want, bytes):
        assert amqp_properties.encode(message.properties, theirs) == want
    else:
        with pytest.raises(want):
            amqp_properties.encode(message.properties, theirs)


def test_held_an_apps_delete_wakes_and_its_own_setting_silences_only_itself(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO staged_jobs (job_name) SELECT 'app.x' FROM generate_series(1, 3)")
    one = "DELETE FROM staged_jobs WHERE id = (SELECT min(id) FROM staged_jobs)"
    assert notifications(database, one) == 1
    assert notifications(database, "SET drain.settling = 'on';\n" + one) == 0  # its own choice
    assert notifications(database, one) == 1  # the next session is not silenced
    assert notifications(database, one, rollback=True) == 0  # a rolled-back DELETE wakes nobody


def test_held_a_cascaded_delete_fires_the_statement_trigger_once(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE parent (id int PRIMARY KEY)")
        conn.execute("ALTER TABLE staged_jobs ADD COLUMN parent_id int REFERENCES parent ON DELETE CASCADE")
        conn.execute("CREATE INDEX ON staged_jobs (parent_id)")
        conn.execute("INSERT INTO parent SELECT g FROM generate_series(1, 20000) g")
        conn.execute(
            "INSERT INTO staged_jobs (job_name, parent_id) SELECT 'app.x', g FROM generate_series(1, 20000) g"
        )
        conn.execute(
            "CREATE TABLE fired (n int); CREATE FUNCTION count_fired() RETURNS trigger LANGUAGE plpgsql "
            "AS $$BEGIN INSERT INTO fired VALUES (1); RETURN NULL; END$$; CREATE TRIGGER zz_count AFTER "
            "DELETE ON staged_jobs FOR EACH STATEMENT EXECUTE FUNCTION count_fired()"
        )
    assert notifications(database, "DELETE FROM parent") == 1
    with psycopg.connect(database, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM fired").fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM staged_jobs").fetchone() == (0,)


def test_held_a_non_finite_number_never_reaches_the_adapter() -> None:
    with pytest.raises(reading.Unreadable):
        reading._object('{"headers": {"a": 1e400}}', "options")


def test_a_relay_on_a_slow_link_forwards_a_backlog_of_large_rows(database: str) -> None:
    rabbit.need_rabbitmq()
    throttle = Throttle(5672, rate=2_000_000)
    (queue,) = names = (rabbit.unique_name("r35-slowrelay"),)
    url = f"amqp://guest:guest@127.0.0.1:{throttle.port}//"
    backends = {
        "default": config.BackendSettings(
            "default", "celery", 10, {"broker_url": url, "allowed_jobs": ["app.**"]}
        )
    }
    settings = config.Settings(
        dsn=database,
        poll_max_s=0.2,
        standby_retry_s=0.2,
        retry_base_s=0.05,
        publish_timeout_s=2.0,
        backends=backends,
    )
    try:
        with rabbit.queues(rabbit.SHARED_URL, *names):
            with psycopg.connect(database) as conn:
                drain.stage_many(
                    conn, [drain.Job("app.tasks.send", args=["x" * 200_000], queue=queue) for _ in range(60)]
                )
            started = time.monotonic()
            with rabbit.running_relay(settings):
                while rabbit.staged_count(database) and time.monotonic() - started < 30:
                    time.sleep(0.5)
            left = rabbit.staged_count(database)
            copies = rabbit.take_counts(rabbit.SHARED_URL, names, by="correlation_id")
    finally:
        throttle.close()
    print(
        f"left {left} of 60 after {time.monotonic() - started:.0f} s; the queue got {sum(copies.values())} "
        f"messages for {len(copies)} rows, at most {max(copies.values(), default=0)} copies of one"
    )
    assert left == 0


def test_the_delete_trigger_follows_its_siblings_enable_always_on_upgrade(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:  # an install from before c246ea2
        conn.execute("DROP TRIGGER drain_wake_freed ON staged_jobs")
        conn.execute("ALTER TABLE staged_jobs ENABLE ALWAYS TRIGGER drain_wake")
        conn.execute("ALTER TABLE staged_jobs ENABLE ALWAYS TRIGGER drain_wake_due")
        conn.execute("INSERT INTO staged_jobs (job_name) VALUES ('app.x')")
    db = store.Store(config.Settings(dsn=database))
    try:
        db.migrate()
    finally:
        db.close()
    replica = "SET session_replication_role = replica;\n"
    assert notifications(database, replica + "INSERT INTO staged_jobs (job_name) VALUES ('app.y')") == 1
    assert notifications(database, replica + "DELETE FROM staged_jobs WHERE job_name = 'app.x'") == 1


def test_held_an_unprivileged_apps_delete_and_a_security_definer_delete_wake(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO staged_jobs (job_name) SELECT 'app.x' FROM generate_series(1, 3)")
        conn.execute(
            "CREATE FUNCTION cancel_one() RETURNS void LANGUAGE sql SECURITY DEFINER "
            "SET search_path = public AS "
            "$$DELETE FROM staged_jobs WHERE id = (SELECT min(id) FROM staged_jobs)$$"
        )
    one = "DELETE FROM staged_jobs WHERE id = (SELECT min(id) FROM staged_jobs)"
    with roles.drain_role(database, prefix="r35_app") as app:
        roles.execute(database, f"GRANT EXECUTE ON FUNCTION cancel_one() TO {roles.user_of(app)}")
        assert notifications(app, one) == 1
        assert notifications(app, "SELECT cancel_one()") == 1
        roles.execute(database, f"REVOKE EXECUTE ON FUNCTION cancel_one() FROM {roles.user_of(app)}")


JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=90)
    | st.sampled_from(["é" * 80, "'\"\\\n\t", "\u2028\U0001f600", "x" * 74, "x" * 75, "x" * 76])
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
RQ_OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "timeout": st.sampled_from([-1, 1, 30, 86400]),
        "result_ttl": st.sampled_from([-1, 0, 60]),
        "failure_ttl": st.sampled_from([-1, 0, 60]),
        "ttl": st.sampled_from([60, 600]),
        "description": st.text(min_size=1, max_size=20),
        "meta": st.dictionaries(st.text(max_size=6), JSON_LEAVES, max_size=3),
        "at_front": st.booleans(),
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    args=st.lists(JSON_VALUES, max_size=4),
    kwargs=st.dictionaries(st.text(min_size=1, max_size=8), JSON_VALUES, max_size=3),
    opts=RQ_OPTIONS,
    serializer=st.sampled_from(["json", "pickle"]),
)
def test_held_the_rq_hash_is_enqueue_manys_for_any_json(
    redis_db: str, args: list[Any], kwargs: dict[str, Any], opts: dict[str, Any], serializer: str
) -> None:
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_db)
    queue, job_id = f"r35-rq-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
    try:
        data = rq.Queue.prepare_data(
            "json.dumps",
            args=args,
            kwargs=kwargs,
            timeout=opts.get("timeout"),
            result_ttl=opts.get("result_ttl"),
            ttl=opts.get("ttl"),
            failure_ttl=opts.get("failure_ttl"),
            description=opts.get("description"),
            job_id=job_id,
            at_front=opts.get("at_front", False),
            meta=opts.get("meta"),
        )
        pipe = client.pipeline()
        rq.Queue(queue, connection=client, serializer=serializer).enqueue_many([data], pipeline=pipe)
        pipe.execute()
        theirs = client.hgetall(f"rq:job:{job_id}")
        client.delete(f"rq:job:{job_id}", f"rq:queue:{queue}")
        adapter = rq_adapter.RQAdapter.from_options(
            "default",
            {"url": redis_db, "serializer": serializer, "allowed_jobs": ["json.dumps"]},
            publish_timeout_s=5,
        )
        adapter.open()
        try:
            job = row(queue, 1, job_id=uuid.UUID(job_id), job_name="json.dumps", args=args, kwargs=kwargs)
            (result,) = adapter.publish_batch([dataclasses.replace(job, options=opts)])
        finally:
            adapter.close()
        assert result.outcome is models.Outcome.PUBLISHED, result
        ours = client.hgetall(f"rq:job:{job_id}")
    finally:
        client.delete(f"rq:job:{job_id}", f"rq:queue:{queue}")
        client.srem("rq:queues", f"rq:queue:{queue}")
        client.close()
    ours.pop(rq_message.MARK_FIELD)
    assert set(ours) == set(theirs)
    loads = serializers.JSONSerializer.loads if serializer == "json" else serializers.DefaultSerializer.loads
    for field, value in theirs.items():
        if field in (b"created_at", b"enqueued_at"):
            continue
        if field == b"data":
            assert loads(zlib.decompress(ours[field])) == loads(zlib.decompress(value)), field
        elif field == b"meta":
            assert loads(ours[field]) == loads(value), field
        else:
            assert ours[field] == value, (field, ours[field], value)


def test_held_a_batch_returned_unroutable_in_bulk_is_read_after_the_write() -> None:
    """The batch is written without reading: 200 rows of 500 KB to a queue deleted under the drain
    come back as 100 MB of basic.return, read in collect, and the rows retry; the next goes in."""
    rabbit.need_rabbitmq()
    queue = rabbit.unique_name("r35-returned")
    celery = adapter()
    celery.open()
    try:
        assert [r.outcome for r in celery.publish_batch([row(queue, 1)])] == [models.Outcome.PUBLISHED]
        rabbit.delete_queues(rabbit.SHARED_URL, queue)
        batch = [row(queue, n, args=["x" * 500_000]) for n in range(2, 202)]
        first = celery.publish_batch(batch)
        second = celery.publish_batch(batch)
    finally:
        celery.close()
        rabbit.delete_queues(rabbit.SHARED_URL, queue)
        rabbit.delete_exchange(rabbit.SHARED_URL, queue)
    assert {r.outcome for r in first} == {models.Outcome.RETRY}
    assert {r.outcome for r in second} == {models.Outcome.PUBLISHED}


def test_held_a_connection_reset_mid_write_counts_only_what_the_broker_confirmed() -> None:
    """The link is reset while a batch of 4 MB goes through it (a frame cut in half): a row of it
    is PUBLISHED only when the broker has it (confirmed before the reset), none is REJECTED, the
    rest wait, and the next batch goes out on a new connection."""
    rabbit.need_rabbitmq()
    throttle = Throttle(5672, rate=2_000_000)
    (queue,) = names = (rabbit.unique_name("r35-reset"),)
    results: list[models.PublishResult] = []
    batch = [row(queue, n, args=["x" * 200_000]) for n in range(1, 21)]
    try:
        with rabbit.queues(rabbit.SHARED_URL, *names):
            celery = adapter(f"amqp://guest:guest@127.0.0.1:{throttle.port}//", publish_timeout_s=5)
            celery.open()
            try:
                timer = threading.Timer(0.5, throttle.cut)
                timer.start()
                with contextlib.suppress(drain.BackendUnavailable):
                    results = celery.publish_batch(batch)
                timer.join()
                again = celery.publish_batch([row(queue, n) for n in range(21, 26)])
            finally:
                celery.close()
            held = rabbit.take_counts(rabbit.SHARED_URL, names, by="correlation_id")
    finally:
        throttle.close()
    by_id = {job.id: str(job.job_id) for job in batch}
    published = [by_id[r.row_id] for r in results if r.outcome is models.Outcome.PUBLISHED]
    print(f"{len(published)} of 20 published before the reset; the broker holds {len(held) - 5} of them")
    assert all(job_id in held for job_id in published)
    assert models.Outcome.REJECTED not in {r.outcome for r in results}
    assert [r.outcome for r in again] == [models.Outcome.PUBLISHED] * 5
