"""G1/G2/G3 end to end: concurrent app transactions, a real ``drain run``, real ``rq worker``s."""

from __future__ import annotations

import psycopg

from tests.support import ledger, processes
from tests.support.load import Load
from tests.support.rig import Rig


def test_committed_run_rolled_back_never_nothing_before_commit(rig: Rig) -> None:
    drain = rig.start_drain()
    with processes.running(drain):
        result = Load(rig.dsn, 5_000, threads=4, queue=rig.queue).start().join()
        tally = ledger.wait_drained(rig.dsn, len(result.committed))
        assert drain.alive(), rig.logs()
    print(f"\n{result.transactions} transactions ({result.held} held open): {tally}")

    assert len(tally.committed) == len(result.committed) > 2_500
    assert len(result.rolled_back) > 1_000
    assert not tally.lost, "G1: a committed job never ran"
    assert not tally.phantom, "G2: a job ran that no committed transaction staged"
    assert tally.early == 0, "G3: a job ran before its transaction's last statement"
    assert tally.remaining == 0
    assert tally.duplicates == 0, "a job ran twice though no process died"
    with psycopg.connect(rig.dsn) as conn:
        ran = {row[0] for row in conn.execute("SELECT job_id FROM deliveries")}
        # the scenario really had later ids committing before earlier ones
        (out_of_order,) = conn.execute(
            "SELECT count(*) FROM committed a JOIN committed b "
            "ON a.max_row_id > b.max_row_id AND a.committed_at < b.committed_at"
        ).fetchone() or (0,)
        (workers,) = conn.execute("SELECT count(DISTINCT worker) FROM deliveries").fetchone() or (0,)
    assert not ran & result.rolled_back, "G2: a rolled-back job ran"
    assert ran >= result.committed
    assert out_of_order > 0
    assert workers >= 2


def test_the_early_check_catches_jobs_staged_outside_a_transaction(rig: Rig) -> None:
    """Control for G3: staging in autocommit mode (an app bug) is caught by the ``early`` count."""
    drain = rig.start_drain()
    with processes.running(drain):
        load = Load(
            rig.dsn,
            20,
            threads=2,
            per_transaction=(1, 5),
            rollback_fraction=0,
            hold_fraction=1,
            hold_s=(2.0, 3.0),
            queue=rig.queue,
            autocommit=True,
        )
        result = load.start().join()
        tally = ledger.wait_drained(rig.dsn, len(result.committed))
    assert tally.early > 0, tally
