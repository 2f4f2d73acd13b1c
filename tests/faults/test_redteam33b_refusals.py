"""Red team (issue 33, second pass): backend-wide causes that still dead-letter rows.

Finding: on NATS JetStream a *deleted stream* (an operator's ``nats stream rm``, or a stream
recreated under another subject filter) makes every row of every queue the stream covered
REJECTED ("no stream covers subject ..."), so with ``max_attempts`` they are dead-lettered.
docs/guarantees.md ("Whose fault is a refusal") calls a deleted queue / no route the queue's
fault (RETRY, uncounted) and G6 says refusals of a whole backend or queue dead-letter nothing;
one stream covering ``prefix.*`` is the whole backend. The relay's net for "every job of a call
refused across more than one queue" only looks at RETRY results, never at REJECTED ones, so it
does not catch this either.

Expected: dead 0, the rows wait (and flow when the stream is back). Observed: every row staged
while the stream was gone is in staged_jobs_dead.
"""

from __future__ import annotations

import time
from pathlib import Path

import psycopg

from tests.support import configs, jetstream, processes, rabbit
from tests.support.waiting import wait_until

BACKEND = "events"


def _count(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        return int(row[0]) if row else 0


def test_a_deleted_nats_stream_dead_letters_nothing(database: str, tmp_path: Path) -> None:
    jetstream.need_nats()
    stream = jetstream.unique_name("RT33GONE")
    queues = ("email", "reports")
    section = {"type": "nats", "url": jetstream.SHARED_URL, "subject_prefix": stream, "queues": list(queues)}
    config = configs.write_config(
        tmp_path / "drain.toml", database, {BACKEND: section}, batch_size=20, max_attempts=1
    )
    jetstream.add_stream([jetstream.SHARED_URL], stream, [f"{stream}.*"])
    drain = processes.start_drain(config, None, tmp_path / "drain.log")
    try:
        rabbit.stage_jobs(database, 10, queues, BACKEND)
        wait_until("the first jobs published", lambda: rabbit.staged_count(database) == 0, 30)
        jetstream.delete_stream([jetstream.SHARED_URL], stream)  # the operator removes the stream
        committed = rabbit.stage_jobs(database, 40, queues, BACKEND)
        time.sleep(5)
        dead = _count(database, "staged_jobs_dead")
        staged = rabbit.staged_count(database)
    finally:
        drain.stop()
        jetstream.delete_stream([jetstream.SHARED_URL], stream)
    print(f"committed {len(committed)}, still staged {staged}, dead {dead}")
    assert dead == 0, f"{dead} of {len(committed)} rows dead-lettered because the stream was deleted"
    assert staged == len(committed)
