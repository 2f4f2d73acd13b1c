"""A missing or disabled drain_wake trigger is reported before it costs anything (issue 14):
``drain check`` warns in one line that says what to do, and a leading ``drain run`` logs it once.
With ``wakeup = "poll"`` nothing is said: the trigger is not needed.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from drain import config
from drain.relay import wakeup
from drain.store import session as store
from tests.support import configs, processes
from tests.support.waiting import wait_until
from tests.wakeup.test_wakeup import wake_lock_holder

WARNING = "the wake-up trigger drain_wake"


def write(tmp_path: Path, database: str, redis_db: str, **keys: object) -> Path:
    return configs.write_config(tmp_path / "drain.toml", database, {"default": configs.rq(redis_db)}, **keys)


def check(path: Path, database: str) -> tuple[int, str]:
    done = processes.drain_cli("check", "--config", str(path), dsn=database)
    return done.returncode, done.stdout + done.stderr


BREAK = {
    "dropped": "DROP TRIGGER drain_wake ON staged_jobs",
    "disabled": "ALTER TABLE staged_jobs DISABLE TRIGGER drain_wake",
}


@pytest.mark.parametrize("how", sorted(BREAK))
def test_drain_check_warns_about_a_missing_or_disabled_trigger(
    database: str, redis_db: str, tmp_path: Path, how: str
) -> None:
    path = write(tmp_path, database, redis_db)
    code, output = check(path, database)
    assert code == 0 and WARNING not in output, output

    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(BREAK[how])
    code, output = check(path, database)
    assert code == 0, output  # the drain still works, on the poll: a warning, not a failure
    warnings = [line for line in output.splitlines() if WARNING in line]
    assert len(warnings) == 1, output
    assert warnings[0].startswith("drain: warning: ")
    for advice in ("drain migrate", "ENABLE TRIGGER drain_wake", 'wakeup = "poll"', '"public"."staged_jobs"'):
        assert advice in warnings[0]

    code, output = check(write(tmp_path, database, redis_db, wakeup="poll"), database)
    assert code == 0 and WARNING not in output, output


def test_drain_migrate_restores_a_dropped_trigger(database: str) -> None:
    db = store.Store(config.Settings(dsn=database))
    try:
        db.conn.execute(BREAK["dropped"])
        assert wakeup.trigger_warning(db) is not None
        db.migrate()
        assert wakeup.trigger_warning(db) is None
    finally:
        db.close()


def test_a_leading_drain_logs_the_missing_trigger_once(database: str, redis_db: str, tmp_path: Path) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(BREAK["dropped"])
    path = write(tmp_path, database, redis_db, poll_min_s=0.05, poll_max_s=0.2, wakeup_poll_max_s=0.2)
    process = processes.start_drain(path, database, tmp_path / "drain.log")
    with processes.running(process):
        first = wait_until("the drain to lead and sleep armed", lambda: wake_lock_holder(database), 30)
        wait_until("the missing trigger logged", lambda: WARNING in process.output(), 10)
        with psycopg.connect(database, autocommit=True) as conn:  # a new session: checked again
            conn.execute("SELECT pg_terminate_backend(%s)", (first,))
        wait_until("the drain to listen again", lambda: wake_lock_holder(database) not in (None, first), 30)
    assert process.output().count(WARNING) == 1, process.output()
