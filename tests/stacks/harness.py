"""One proof for every way of staging: committed → delivered, rolled back → never, and invisible
to a drain until commit.

A test stages a job marked "committed" on its stack, then calls :meth:`StackRig.drain_sees_nothing`
while its transaction is still open (a real ``drain run --once`` forwards nothing, and the RQ
queue stays empty), commits, stages a job marked "rolled back" and rolls it back, then calls
:meth:`StackRig.only_committed_delivered`: a second ``drain run --once`` forwards the committed
job to Redis and a real ``rq worker --burst`` runs it, recording each run in ``deliveries``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

from tests.support import configs, ledger, processes
from tests.support.waiting import wait_until

COMMITTED = "committed"
ROLLED_BACK = "rolled back"
TASK = "tests.support.tasks.record"
RUN_TIMEOUT_S = 120.0


@dataclasses.dataclass
class StackRig:
    dsn: str
    redis_url: str
    queue: str
    config: Path
    tmp: Path

    def drain_once(self) -> None:
        done = processes.drain_cli("run", "--once", "--config", str(self.config), dsn=self.dsn)
        assert done.returncode == 0, done.stdout + done.stderr

    def queued(self) -> int:
        with redis.Redis.from_url(self.redis_url) as client:
            return int(client.llen(f"rq:queue:{self.queue}"))

    def staged_elsewhere(self) -> int:
        """Staged rows as another session (the drain's view) sees them."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
        assert row is not None
        return int(row[0])

    def delivered(self) -> list[list[object]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return [row[0] for row in conn.execute("SELECT args FROM deliveries ORDER BY delivered_at")]

    def drain_sees_nothing(self) -> None:
        """Call with the staging transaction still open."""
        assert self.staged_elsewhere() == 0, "an uncommitted job is visible to other sessions"
        self.drain_once()
        assert self.queued() == 0, "the drain forwarded a job before its transaction committed"
        assert self.delivered() == []

    def only_committed_delivered(self, expected: int = 1) -> None:
        """Call after the commit and the rollback: exactly the committed job(s) run."""
        wait_until("the committed job(s) staged", lambda: self.staged_elsewhere() == expected, 10)
        self.drain_once()
        assert self.staged_elsewhere() == 0, "the drain left a committed job behind"
        assert self.queued() == expected
        worker = subprocess.run(
            [processes.RQ, "worker", "--burst", "--url", self.redis_url,
             "--worker-class", "rq.worker.SimpleWorker", "--quiet", self.queue],
            env=processes.environment(self.dsn), cwd=processes.ROOT, capture_output=True,
            text=True, timeout=RUN_TIMEOUT_S, check=False,
        )  # fmt: skip
        assert worker.returncode == 0, worker.stdout + worker.stderr
        assert self.delivered() == [[COMMITTED]] * expected


@pytest.fixture(name="stack")
def stack_fixture(database: str, redis_db: str, tmp_path: Path) -> Iterator[StackRig]:
    ledger.install(database)
    queue = f"drain-stage-{uuid.uuid4().hex[:8]}"
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rq(redis_db, processes.ALLOWED_JOBS)}
    )
    yield StackRig(database, redis_db, queue, config, tmp_path)
