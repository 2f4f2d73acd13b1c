"""G1/G4 on the pipelined RabbitMQ path: the leader dies (``os._exit``, like SIGKILL) while
batches are in flight — submitted to the broker, their confirms not yet collected, their rows not
deleted. A restarted drain finishes the table: every committed job is in the broker (lost = 0);
what was in flight at the crash is published again (duplicates, which consumers dedupe by
``message_id``). Shared broker, queues of the test's own."""

from __future__ import annotations

import collections
import uuid
from pathlib import Path

import pytest

from tests.support import configs, faultload, ledger, processes, rabbit

BACKEND = "events"
BATCH = 100
DEPTH = 4
COMMITTED = 1_000


@pytest.fixture(autouse=True)
def _need_broker() -> None:
    rabbit.need_rabbitmq()


def write_config(path: Path, dsn: str) -> Path:
    backends = {BACKEND: configs.rabbitmq(rabbit.SHARED_URL)}
    return configs.write_config(path, dsn, backends, batch_size=BATCH, pipeline_depth=DEPTH)


@pytest.mark.parametrize("failpoint", ["after_publish=exit@3", "after_commit=exit@3", "after_delete=exit@6"])
def test_a_crash_with_batches_in_flight_loses_nothing(failpoint: str, database: str, tmp_path: Path) -> None:
    names = tuple(rabbit.unique_name(f"crash{n}") for n in range(2))
    with rabbit.queues(rabbit.SHARED_URL, *names):
        committed = rabbit.stage_jobs(database, COMMITTED, names, BACKEND, per_txn=250)
        config = write_config(tmp_path / "drain.toml", database)

        crashed = processes.start_drain(config, None, tmp_path / "crashed.log", failpoints=failpoint)
        assert crashed.wait() == 137, crashed.output()
        left = rabbit.staged_count(database)
        if failpoint.startswith(("after_publish", "after_commit")):
            # three full steps submitted 300 jobs, none collected yet: nothing may be deleted
            assert left == COMMITTED, f"{COMMITTED - left} rows deleted before their confirms were collected"
        assert left > 0, "the crash left nothing to finish"

        finisher = processes.start_drain(config, None, tmp_path / "finisher.log")
        with processes.running(finisher):
            ledger.wait_drained(database)
        assert finisher.popen.returncode == 0, finisher.output()
        held = rabbit.take_counts(rabbit.SHARED_URL, names)

    tally = ledger.Tally(
        committed={uuid.UUID(i) for i in committed},
        delivered=collections.Counter({uuid.UUID(i): count for i, count in held.items()}),
        remaining=rabbit.staged_count(database),
    )
    faultload.report(f"rabbitmq pipelined crash {failpoint}", tally)
    tally.check()
