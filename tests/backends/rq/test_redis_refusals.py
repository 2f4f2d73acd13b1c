"""G1 G6 G10: a Redis that refuses every write is an outage, never a reason to dead-letter a row.

One private redis-server for the module; for the RQ backend and for Celery on Redis, one real
``drain run`` lives through every refusal in turn (READONLY, OOM, MISCONF, NOREPLICAS, BUSY,
LOADING: tests.support.redis_refusals). For each: the server refuses, jobs are staged, the drain
reports the backend unavailable with the server's own reason at least twice, and meanwhile every
row is still staged, untouched (attempts 0, no error) and nothing is dead-lettered; then the
server heals and the drain forwards them by itself. At the end the jobs are read back from Redis
by id: committed / delivered / dead / lost.

The same for an ACL that takes a write command from the drain's own Redis user mid-run (``-rpush``,
then ``-@write``): inside the RQ script Redis words it with the generic ``ERR`` code, and it is an
outage all the same. And for a key every job writes besides its own refused (issue 33): RQ's
shared ``rq:queues`` holding a string, an ACL user that may not write it, or the job keys; for
Celery an ACL user that may not write the queue's list. A permission or a shared key is the
backend's, never the row's.
"""

from __future__ import annotations

import collections
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import redis

import drain
from drain.relay import forward
from tests.support import celery_rig, configs, faultload, ledger, processes, redis_refusals, redis_server
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

JOBS_PER_REFUSAL = 8
ACL_USER = "drain_acl"
ACL_PASSWORD = "acl-test-password"
ACL_REFUSALS = (
    redis_refusals.acl_revoking(ACL_USER, "-rpush"),
    redis_refusals.acl_revoking(ACL_USER, "-@write"),
)
KEY_REFUSALS = (  # issue 33: each dead-lettered every job of every queue within seconds
    redis_refusals.wrong_type("rq:queues"),  # the registry every RQ job writes besides its own keys
    # Redis checks a script's declared keys against the ACL before it runs: NOPERM for the call
    redis_refusals.acl_keys(ACL_USER, "NOPERM", "rq:job:*", "rq:queue:*"),  # not rq:queues
    redis_refusals.acl_keys(ACL_USER, "NOPERM", "rq:queue*"),  # not the job keys
)
CELERY_KEY_REFUSALS = (redis_refusals.acl_keys(ACL_USER, "NOPERM", "unrelated:*"),)
REPORTS_WANTED = 2  # "unavailable" log lines per refusal: the drain retried, and still waited
DEADLINE_S = 60.0

Delivered = Callable[[str, str], collections.Counter[uuid.UUID]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis_server.RedisServer]:
    private = redis_server.RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False)
    private.start()
    try:
        yield private
    finally:
        private.stop()


def rq_delivered(url: str, queue: str) -> collections.Counter[uuid.UUID]:
    return faultload.delivered(url, [queue])


def celery_delivered(url: str, queue: str) -> collections.Counter[uuid.UUID]:
    """Task ids of the kombu envelopes on the queue's list."""
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        envelopes = client.lrange(queue, 0, -1)
    finally:
        client.close()
    return collections.Counter(uuid.UUID(json.loads(raw)["headers"]["id"]) for raw in envelopes)


def stage(dsn: str, queue: str, count: int) -> set[uuid.UUID]:
    ids = {uuid.uuid4() for _ in range(count)}
    jobs = [drain.Job(celery_rig.ALLOWED_JOBS[0], args=[str(i)], queue=queue, job_id=i) for i in ids]
    with psycopg.connect(dsn) as conn, conn.cursor() as cursor:
        drain.stage_many(cursor, jobs)
    return ids


def untouched(dsn: str) -> tuple[int, int, int]:
    """(staged rows, of them never attempted and without an error, dead-lettered rows)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE attempts = 0 AND last_error IS NULL),"
            " (SELECT count(*) FROM staged_jobs_dead) FROM staged_jobs"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def reports(log: str, code: str) -> int:
    return sum(1 for line in log.splitlines() if "unavailable" in line and code in line)


def one_refusal(
    refusal: redis_refusals.Refusal,
    server: redis_server.RedisServer,
    dsn: str,
    queue: str,
    drain_process: processes.Process,
) -> set[uuid.UUID]:
    """Inject, stage, see the drain wait with the rows untouched, heal, see them forwarded."""
    seen = reports(drain_process.output(), refusal.code)
    heal = refusal.inject(server)
    try:
        staged_ids = stage(dsn, queue, JOBS_PER_REFUSAL)
        wait_until(
            f"the drain to report {refusal.code} twice",
            lambda: (
                reports(drain_process.output(), refusal.code) >= seen + REPORTS_WANTED
                or untouched(dsn)[2] > 0
            ),
            DEADLINE_S,
        )
        staged, clean, dead = untouched(dsn)
        assert (staged, clean, dead) == (JOBS_PER_REFUSAL, JOBS_PER_REFUSAL, 0), (
            f"{refusal.code}: rows must wait untouched, nothing dead-lettered "
            f"(staged, untouched, dead = {staged}, {clean}, {dead})\n{drain_process.output()[-3000:]}"
        )
    finally:
        heal()
    resumed = f"forwarding to resume after {refusal.code}"
    wait_until(resumed, lambda: untouched(dsn)[0] == 0, DEADLINE_S)
    return staged_ids


def live_through_every_refusal(
    server: redis_server.RedisServer,
    dsn: str,
    config: Path,
    tmp_path: Path,
    queue: str,
    delivered: Delivered,
    refusals: tuple[redis_refusals.Refusal, ...] = redis_refusals.REFUSALS,
    label: str = "READONLY OOM MISCONF NOREPLICAS BUSY LOADING",
) -> None:
    committed: set[uuid.UUID] = set()
    drain_process = processes.start_drain(config, dsn, tmp_path / "drain.log")
    with processes.running(drain_process):
        for refusal in refusals:
            committed |= one_refusal(refusal, server, dsn, queue, drain_process)
        assert drain_process.alive(), drain_process.output()[-3000:]
    with psycopg.connect(dsn) as conn:
        dead = {row[0] for row in conn.execute("SELECT job_id FROM staged_jobs_dead")}
    tally = ledger.Tally(committed, delivered(server.url, queue), dead)
    faultload.report(f"redis refusing writes: {label}", tally)
    assert not tally.dead
    tally.check()
    assert tally.duplicates == 0, tally


def test_rq_waits_through_every_refusal(
    server: redis_server.RedisServer, database: str, tmp_path: Path
) -> None:
    queue = f"refusals-{uuid.uuid4().hex[:8]}"
    backend = configs.rq(server.url, allowed_jobs=celery_rig.ALLOWED_JOBS[:1], socket_timeout_s=2.0)
    config = configs.write_config(tmp_path / "drain.toml", database, {"default": backend})
    live_through_every_refusal(server, database, config, tmp_path, queue, rq_delivered)


def test_celery_on_redis_waits_through_every_refusal(
    server: redis_server.RedisServer, database: str, tmp_path: Path
) -> None:
    queue = f"refusals-{uuid.uuid4().hex[:8]}"
    config = celery_rig.write_config(tmp_path / "drain.toml", database, server.url, publish_timeout_s=2.0)
    live_through_every_refusal(server, database, config, tmp_path, queue, celery_delivered)


def test_rq_waits_while_an_acl_takes_a_write_command_from_its_user(
    server: redis_server.RedisServer, database: str, tmp_path: Path
) -> None:
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", ACL_USER, "reset", "on", f">{ACL_PASSWORD}", "~*", "&*", "+@all")
    try:
        queue = f"acl-{uuid.uuid4().hex[:8]}"
        url = f"redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{server.port}/0"
        backend = configs.rq(url, allowed_jobs=celery_rig.ALLOWED_JOBS[:1], socket_timeout_s=2.0)
        config = configs.write_config(tmp_path / "drain.toml", database, {"default": backend})
        live_through_every_refusal(
            server, database, config, tmp_path, queue, rq_delivered, ACL_REFUSALS, "ACL -rpush, -@write"
        )
    finally:
        admin.execute_command("ACL", "DELUSER", ACL_USER)


@pytest.fixture
def acl_user(server: redis_server.RedisServer) -> Iterator[str]:
    """The URL of a Redis user of the test's own, allowed everything; deleted afterwards."""
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", ACL_USER, "reset", "on", f">{ACL_PASSWORD}", "~*", "&*", "+@all")
    try:
        yield f"redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{server.port}/0"
    finally:
        admin.execute_command("ACL", "DELUSER", ACL_USER)


def test_rq_waits_while_a_key_every_job_writes_is_refused(
    server: redis_server.RedisServer, database: str, tmp_path: Path, acl_user: str
) -> None:
    queue = f"keys-{uuid.uuid4().hex[:8]}"
    backend = configs.rq(acl_user, allowed_jobs=celery_rig.ALLOWED_JOBS[:1], socket_timeout_s=2.0)
    config = configs.write_config(tmp_path / "drain.toml", database, {"default": backend})
    live_through_every_refusal(
        server, database, config, tmp_path, queue, rq_delivered, KEY_REFUSALS, "rq:queues, ACL keys"
    )


def test_celery_on_redis_waits_while_an_acl_refuses_its_queue_key(
    server: redis_server.RedisServer, database: str, tmp_path: Path, acl_user: str
) -> None:
    queue = f"keys-{uuid.uuid4().hex[:8]}"
    config = celery_rig.write_config(tmp_path / "drain.toml", database, acl_user, publish_timeout_s=2.0)
    live_through_every_refusal(
        server, database, config, tmp_path, queue, celery_delivered, CELERY_KEY_REFUSALS, "ACL keys"
    )


@pytest.mark.parametrize("kind", ["rq", "celery"])
def test_a_queue_whose_key_holds_another_type_waits_and_the_others_flow(
    server: redis_server.RedisServer, database: str, tmp_path: Path, kind: str
) -> None:
    """Issue 33: a queue's key of the wrong type is the queue's fault, not its rows': they wait
    uncounted (a line and drain_queue_refusing say so), the other queues flow, and once the key
    is gone they are forwarded within the queue's backoff. Nothing is dead-lettered."""
    queues = [f"wrongtype-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    bad = queues[0]
    key = f"rq:queue:{bad}" if kind == "rq" else bad
    if kind == "rq":
        backend = configs.rq(server.url, allowed_jobs=celery_rig.ALLOWED_JOBS[:1], socket_timeout_s=2.0)
        config = configs.write_config(tmp_path / "drain.toml", database, {"default": backend}, max_attempts=2)
        delivered: Delivered = rq_delivered
    else:
        config = celery_rig.write_config(
            tmp_path / "drain.toml", database, server.url, publish_timeout_s=2.0, max_attempts=2
        )
        delivered = celery_delivered
    healed = [redis_refusals.wrong_type(key).inject(server)]  # emptied once healed
    committed = {queue: stage(dsn=database, queue=queue, count=7) for queue in queues}
    drain_process = processes.start_drain(config, database, tmp_path / "drain.log")
    try:
        with processes.running(drain_process):
            refusing = f"queue {bad} refuses its jobs"
            wait_until(
                "the other queues forwarded and the refusing queue reported twice",
                lambda: (
                    (untouched(database)[0] == 7 and drain_process.output().count(refusing) >= 2)
                    or untouched(database)[2] > 0
                ),
                DEADLINE_S,
            )
            with psycopg.connect(database) as conn:
                rows = conn.execute("SELECT queue, attempts FROM staged_jobs").fetchall()
            assert rows == [(bad, 0)] * 7, rows
            assert untouched(database)[2] == 0
            healed.pop()()
            # the queue's streak of refusals may have reached its cap (the second line is written
            # only after the log's repeat interval): its rows wait up to NACKED_MAX_S for their try
            healing_s = forward.NACKED_MAX_S + 10.0
            wait_until("the refusing queue's rows forwarded", lambda: untouched(database)[0] == 0, healing_s)
            assert drain_process.alive(), drain_process.output()[-3000:]
    finally:
        for heal in healed:
            heal()
    with psycopg.connect(database) as conn:
        dead = {row[0] for row in conn.execute("SELECT job_id FROM staged_jobs_dead")}
    got: collections.Counter[uuid.UUID] = collections.Counter()
    for queue in queues:
        got += delivered(server.url, queue)
    tally = ledger.Tally(set().union(*committed.values()), got, dead)
    faultload.report(f"{kind}: a queue key of another type", tally)
    assert not tally.dead
    tally.check()
