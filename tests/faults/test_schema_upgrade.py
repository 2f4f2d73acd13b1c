"""`drain migrate` upgrades a populated table of drain 0.1.0's schema in place while producers
stage and a new drain waits for it: nothing is lost, every constraint ends validated, and no
producer waits long on a lock.

The new drain, started first, stands by on the old schema (saying to run `drain migrate`) and
forwards nothing there: its settlements are written for the new schema (before, it led on the old
one, where a burial of a row id already dead failed its batch on every step). Once the table is
migrated it leads and forwards everything, the rows staged during the upgrade included.

A producer transaction held open through the upgrade makes the catalog change wait for its lock;
while a change waits, every INSERT queues behind it. The migration's lock_timeout
(drain.store.migrations.LOCK_TIMEOUT_MS) bounds that wait, and it retries. The probe producer stages
under ``lock_timeout = 1s``: one wait longer than that is an error it counts, and there must be
none. (Without the migration's timeout the producers would wait as long as the open transaction
stays open.)
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

import drain
from drain.store import migrations, sql
from tests.support import configs, faultload, ledger, processes, schema_v1
from tests.support.waiting import wait_until

HOLD_MAX_S = 5.0  # the open transaction ends once the migration has retried, or after this
PROBE_LOCK_TIMEOUT = "1s"
LEDGER_ROW = "INSERT INTO ledger (job_id, backend) VALUES (%s, 'default')"
NOT_VALID = "SELECT count(*) FROM pg_constraint WHERE conrelid = 'staged_jobs'::regclass AND NOT convalidated"
PREFILLED = 100  # transactions of 10 jobs, staged before the drain starts
UPGRADE_TIMEOUT_S = 120.0


class Probe(threading.Thread):
    """Stages one job per transaction (with its ledger row) under a lock_timeout: counts the
    waits longer than that, and keeps the longest statement time."""

    def __init__(self, dsn: str, queue: str) -> None:
        super().__init__(daemon=True, name="probe")
        self.dsn = dsn
        self.queue = queue
        self.halt = threading.Event()
        self.lock_timeouts = 0
        self.longest_s = 0.0
        self.staged = 0

    def run(self) -> None:
        with psycopg.connect(self.dsn) as conn:
            conn.execute(f"SET lock_timeout = '{PROBE_LOCK_TIMEOUT}'")  # type: ignore[arg-type]
            conn.commit()
            while not self.halt.is_set():
                job_id = uuid.uuid4()
                started = time.monotonic()
                try:
                    drain.stage(conn, faultload.JOB_NAME, queue=self.queue, job_id=job_id)
                    conn.execute("INSERT INTO ledger (job_id, backend) VALUES (%s, 'default')", (job_id,))
                    conn.commit()
                    self.staged += 1
                except psycopg.errors.LockNotAvailable:
                    conn.rollback()
                    self.lock_timeouts += 1
                self.longest_s = max(self.longest_s, time.monotonic() - started)
                self.halt.wait(0.005)


def bad_rows(dsn: str) -> None:
    """Rows 0.1.0 took and the new constraints refuse: one never due, one with a blank queue."""
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO staged_jobs (job_name, run_at) VALUES ('app.parked', 'infinity')")
        conn.execute(
            "INSERT INTO staged_jobs (job_name, queue, run_at) VALUES ('app.blank', ' ', 'infinity')"
        )


STANDING_BY = f"is at schema version 1, this drain expects {migrations.LATEST_VERSION}: run `drain migrate`"


@pytest.mark.slow
def test_an_upgrade_under_load_loses_nothing_and_bounds_producers_lock_waits(
    redis_db: str, tmp_path: Path
) -> None:
    with schema_v1.empty_database() as dsn:
        schema_v1.install(dsn)
        faultload.prepare(dsn)
        prefilled = faultload.stage_committed(dsn, transactions=PREFILLED, per_transaction=10)
        bad_rows(dsn)
        config = configs.write_config(
            tmp_path / "drain.toml", dsn, {"default": configs.rq(redis_db)}, batch_size=100
        )
        load = faultload.load(dsn, per_transaction=5, pace_s=0.01)
        probe = Probe(dsn, load.queues["default"])
        retries: list[float] = []
        outcome: dict[str, Any] = {}
        drain_process = processes.start_drain(config, None, tmp_path / "drain.log")
        with processes.running(drain_process):
            wait_until(
                "the drain to stand by", lambda: STANDING_BY in drain_process.output(), faultload.DEADLINE_S
            )
            load.start()
            probe.start()
            try:
                wait_until("producers to stage", lambda: probe.staged > 50, faultload.DEADLINE_S)
                assert faultload.deleted(dsn) == 0  # not a row forwarded on the old schema
                with psycopg.connect(dsn) as holder:  # a producer's long transaction
                    drain.stage(holder, faultload.JOB_NAME, queue=load.queues["default"])

                    def upgrade() -> None:
                        with psycopg.connect(dsn, autocommit=True) as conn:
                            started = time.monotonic()
                            outcome["report"] = migrations.upgrade(
                                migrations.Autocommit(conn), sql.Names("public", "staged_jobs"), sleep=sleep
                            )
                            outcome["seconds"] = time.monotonic() - started

                    def sleep(seconds: float) -> None:
                        retries.append(seconds)
                        time.sleep(seconds)

                    migrating = threading.Thread(target=upgrade, name="migrate", daemon=True)
                    migrating.start()
                    with contextlib.suppress(AssertionError):  # asserted below, once it has ended
                        wait_until("a retry of the lock", lambda: len(retries) >= 2, HOLD_MAX_S)
                    holder.rollback()
                migrating.join(UPGRADE_TIMEOUT_S)
                assert "report" in outcome, "the upgrade did not finish"
                after = faultload.deleted(dsn)
                wait_until("progress", lambda: faultload.deleted(dsn) > after + 100, faultload.DEADLINE_S)
            finally:
                probe.halt.set()
                probe.join(30)
                load.stop()
            ledger.wait_drained(dsn)
        result = faultload.tally(dsn, redis_db, prefilled, load)
        faultload.report(
            "schema upgrade under load",
            result,
            migrate_s=round(outcome["seconds"], 2),
            lock_retries=len(retries),
            probe_staged=probe.staged,
            probe_longest_ms=round(probe.longest_s * 1000),
        )
        result.check()
        assert probe.lock_timeouts == 0, f"{probe.lock_timeouts} INSERTs waited over {PROBE_LOCK_TIMEOUT}"
        assert len(retries) >= 2, "the catalog change never met the open transaction"
        report = outcome["report"]
        assert (report.before, report.after, report.buried, report.not_valid) == (
            1,
            migrations.LATEST_VERSION,
            2,
            [],
        )
        with psycopg.connect(dsn) as conn:
            assert conn.execute(NOT_VALID).fetchone() == (0,)
            buried = conn.execute(
                "SELECT job_name, error FROM staged_jobs_dead WHERE job_name LIKE 'app.%' ORDER BY job_name"
            ).fetchall()
        assert buried == [
            ("app.blank", "drain migrate: queue must be a non-empty string (not blank, at most 1024 bytes)"),
            (
                "app.parked",
                "drain migrate: run_at must be from 1970-01-01 to before 9999-01-01 (UTC), not infinity",
            ),
        ]
