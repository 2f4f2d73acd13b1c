"""A real ``drain run``'s memory follows its budget, not the rows (issue 22).

Before the budget, a batch was fetched whole: 50 rows of 2 MB took the drain from about 50 MB to
about 250 MB, one row of 100 MB to over 500 MB (the shipped Kubernetes manifest limits the pod to
256 Mi). Here the drain runs with ``batch_max_bytes`` = 16 MiB: its peak resident memory (the
kernel's VmHWM), measured from its footprint once leading, stays within the README's bound
(``drain.store.reading.memory_bound_bytes``); the 2 MB rows are all delivered to RQ, and the 100 MB row
is dead-lettered unread while the good rows around it flow.

Non-ASCII text costs more than its bytes once it is a message: every backend's JSON escapes ``é``
(2 bytes) to ``\\u00e9`` (6), and Celery on Redis base64-encodes that inside a JSON envelope. 50
rows of 1 MB of ``é`` to Celery on Redis took the drain about 80 MB over its footprint with this
budget, past the bound, when a row weighed 4 bytes per byte of text whatever the text.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path

import psycopg
import pytest
import redis

from drain.store import reading
from tests.support import configs, faultload, ledger, processes
from tests.support.waiting import wait_until

BUDGET = 16 << 20
JOB = "tests.support.faultload.noop"
# 2 MB of hex text per row (md5s: the kind of text Postgres compresses only about 2x).
TWO_MB = (
    "jsonb_build_array((SELECT string_agg(md5((g * 100003 + i)::text), '') FROM generate_series(1, 62500) i))"
)
HUNDRED_MB = "jsonb_build_array(repeat(md5(g::text), 3276800))"
ONE_MB_OF_E = "jsonb_build_array(repeat(chr(224 + g %% 30), 500000))"  # Latin-1: 2 bytes each
CELERY_JOB = "tests.celery.noop"


def vm_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for process {pid}")


def celery_delivered(redis_url: str, queue: str) -> Counter[uuid.UUID]:
    """How many times each task id was pushed onto this Celery queue (kombu's envelopes)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        envelopes = client.lrange(queue, 0, -1)
        client.delete(queue)
    finally:
        client.close()
    return Counter(uuid.UUID(json.loads(envelope)["headers"]["id"]) for envelope in envelopes)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "rows", "expression", "dead"),
    [("rq", 50, TWO_MB, False), ("rq", 1, HUNDRED_MB, True), ("celery", 50, ONE_MB_OF_E, False)],
    ids=["50x2MB", "1x100MB", "celery-redis-50x1MB-non-ASCII"],
)
def test_peak_memory_stays_within_the_bound_whatever_the_rows_hold(
    database: str, redis_db: str, tmp_path: Path, backend: str, rows: int, expression: str, dead: bool
) -> None:
    queue = f"memory-{uuid.uuid4().hex[:8]}"
    job_name = JOB if backend == "rq" else CELERY_JOB
    section = (
        configs.rq(redis_db, [JOB], max_attempts=1)
        if backend == "rq"
        else {"type": "celery", "broker_url": redis_db, "allowed_jobs": [CELERY_JOB], "max_attempts": 1}
    )
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": section}, batch_max_bytes=BUDGET
    )
    drain = processes.start_drain(config, None, tmp_path / "drain.log")
    with processes.running(drain):
        wait_until("the drain to lead", lambda: "leading" in drain.output(), 60)
        base_kb = vm_kb(drain.pid, "VmHWM")
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO staged_jobs (job_name, queue, job_args) SELECT %s, %s, '[0]' "
                "FROM generate_series(1, 5)",
                (job_name, queue),
            )
            big = [
                row[0]
                for row in conn.execute(
                    f"INSERT INTO staged_jobs (job_name, queue, job_args) "
                    f"SELECT %s, %s, {expression} FROM generate_series(1, %s) AS g RETURNING job_id",
                    (job_name, queue, rows),
                )
            ]
            conn.execute(
                "INSERT INTO staged_jobs (job_name, queue, job_args) SELECT %s, %s, '[1]' "
                "FROM generate_series(1, 5)",
                (job_name, queue),
            )
        ledger.wait_drained(database)
        peak_kb = vm_kb(drain.pid, "VmHWM")
        assert drain.popen.poll() is None, drain.output()[-3000:]
    delivered = (
        faultload.delivered(redis_db, [queue]) if backend == "rq" else celery_delivered(redis_db, queue)
    )
    with psycopg.connect(database) as conn:
        errors = dict(conn.execute("SELECT job_id, error FROM staged_jobs_dead").fetchall())
    bound_kb = reading.memory_bound_bytes(BUDGET, base_bytes=base_kb * 1024) // 1024
    print(f"\nrow memory: base {base_kb // 1024} MB, peak {peak_kb // 1024} MB, bound {bound_kb // 1024} MB")
    assert peak_kb <= bound_kb, f"peak {peak_kb} kB over the bound {bound_kb} kB (base {base_kb} kB)"
    assert sum(delivered.values()) == len(delivered) == 10 + (0 if dead else rows)
    if dead:
        assert set(errors) == set(big) and all("it was not fetched" in error for error in errors.values())
    else:
        assert not errors and set(big) <= set(delivered)
