"""G1/G4: the leader is killed (``os._exit``, like SIGKILL) at each step of a batch; a restarted
drain finishes the table. Nothing committed is lost; what was published but not deleted is the
redelivery window, which the RQ adapter suppresses (it skips ids Redis already holds)."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg
import pytest

from tests.support import configs, faultload, processes

STEPS = ["after_select", "mid_publish", "after_publish", "after_delete"]


@pytest.mark.parametrize("depth", [0, 4], ids=["serial", "pipelined"])
@pytest.mark.parametrize("failpoint", STEPS)
def test_sigkill_at_each_step_then_restart_finishes(
    failpoint: str, depth: int, database: str, redis_db: str, tmp_path: Path
) -> None:
    """Serial (pipeline_depth 0): each step publishes and deletes its own batch, so a kill after
    the select leaves nothing published and not deleted. Pipelined: RQ's full batches stay in
    flight for steps, so any kill may leave such a window; the adapter still skips it."""
    faultload.prepare(database)
    backends = {"default": redis_db, "second": redis_db}
    queues = {name: f"faults-{name}-{uuid.uuid4().hex[:6]}" for name in backends}
    load = faultload.stage_committed(
        database, backends=list(backends), queues=queues, transactions=60, per_transaction=5
    )
    config = configs.write_config(
        tmp_path / "drain.toml",
        database,
        {name: configs.rq(redis_db) for name in backends},
        batch_size=50,
        pipeline_depth=depth,
    )

    crashed = processes.start_drain(config, None, tmp_path / "crashed.log", failpoints=f"{failpoint}=exit@3")
    assert crashed.wait() == 137, crashed.output()
    with psycopg.connect(database) as conn:
        left = {row[0] for row in conn.execute("SELECT job_id FROM staged_jobs")}
    held = set(faultload.delivered(redis_db, queues.values()))
    window = left & held  # published by the dead leader, rows still staged: republished on restart
    assert left, "the crash left nothing to finish"
    if failpoint == "after_select" and not depth:
        assert not window
    elif not depth:
        assert window, f"{failpoint}: expected published-but-not-deleted rows"

    restarted = processes.start_drain(config, None, tmp_path / "restarted.log", "--once")
    assert restarted.wait() == 0, restarted.output()

    result = faultload.tally(database, redis_db, load)
    faultload.report(f"kill at {failpoint}", result, redelivery_window=len(window))
    result.check()
    assert result.remaining == 0
    assert result.duplicates == 0  # the adapter skipped the ids Redis already held
