"""Red team 35: ``drain run --once`` on the pipelined RQ backend drains every keyed row (G1).

``drain run --once`` promises to forward what is due now: it stops only when no row is due, only
rows of unavailable backends are left, or a signal came (``Relay.drain_due``). Since it runs the
pipelined loop, full batches stay in flight for a few steps, and a keyed row is not due while the
row before it (same ordering key) is still in the table — in flight included (queries.sql
key_free). With more keys than a batch and several rows per key, a step comes whose select finds
nothing free (every key's next row waits behind one in flight); that step collects and deletes
the flights, which frees the next row of every key. When that empty select was one that looked at
every row (reading.FULL_EVERY), ``drain_due`` took it for "nothing is due", settled and returned:
the process exited 0 ("published 600") with a third of the committed rows still staged and due,
no backend unavailable, nothing retried. Now a step that collected flights is never the last.
With ``pipeline_depth = 0`` the same table drained whole then too.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.support import configs, faultload, processes

KEYS = 150  # three full batches of heads: more keys than a batch, so batches go in flight
PER_KEY = 6


def stage_keyed(dsn: str, queue: str) -> None:
    """KEYS keys with PER_KEY rows each, staged round robin (every key's first row, then the
    second, ...), committed before the drain starts."""
    with psycopg.connect(dsn) as conn, conn.cursor() as cursor:
        cursor.executemany(
            "INSERT INTO staged_jobs (job_name, job_args, queue, backend, ordering_key) "
            "VALUES (%s, %s, %s, 'default', %s)",
            [
                (faultload.JOB_NAME, Jsonb([key, turn]), queue, f"key-{key}")
                for turn in range(PER_KEY)
                for key in range(KEYS)
            ],
        )


def run_once(database: str, redis_db: str, tmp_path: Path, depth: int) -> tuple[int, str, int, int]:
    queue = f"rt35-once-{uuid.uuid4().hex[:6]}"
    stage_keyed(database, queue)
    config = configs.write_config(
        tmp_path / "drain.toml",
        database,
        {"default": configs.rq(redis_db)},
        batch_size=50,
        pipeline_depth=depth,
    )
    done = processes.drain_cli("run", "--once", "--config", str(config), dsn=database, timeout_s=60)
    due = faultload.scalar(
        database, "SELECT count(*) FROM staged_jobs WHERE run_at IS NULL OR run_at <= now()"
    )
    queued = sum(faultload.delivered(redis_db, [queue]).values())
    return done.returncode, done.stdout + done.stderr, int(due), queued


def test_serial_once_drains_every_keyed_row(database: str, redis_db: str, tmp_path: Path) -> None:
    """The control: one whole batch per transaction (pipeline_depth = 0)."""
    code, output, due, queued = run_once(database, redis_db, tmp_path, depth=0)
    assert code == 0, output
    assert (due, queued) == (0, KEYS * PER_KEY), output


@pytest.mark.parametrize("depth", [3, 4])
def test_pipelined_once_drains_every_keyed_row(
    depth: int, database: str, redis_db: str, tmp_path: Path
) -> None:
    code, output, due, queued = run_once(database, redis_db, tmp_path, depth=depth)
    assert code == 0, output
    assert due == 0, f"--once exited {code} with {due} rows due and unpublished: {output}"
    assert queued == KEYS * PER_KEY
