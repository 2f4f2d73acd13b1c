"""G10, settle or do not publish, with real ``drain run`` processes, RabbitMQ and a consumer that
counts every message: a drain that cannot delete what it publishes must not publish it over and
over (on a drain without the guard, 50 jobs became ~2,000 messages in 15 s).

Each fault, as the drain's own least-privilege role:

- ``read_only``: ``default_transaction_read_only=on`` in the DSN, from the start;
- ``no_delete``: ``REVOKE DELETE`` while the drain leads (it has published a batch);
- ``trigger``: a DELETE trigger that raises, created while the drain leads;
- ``skip``: a DELETE trigger that returns NULL (the row stays, no error), created while it leads.

Then: the drain says why on stderr and exits 6 after ``settle_timeout_s`` (measured from the
fault: within a step of it, not a backoff later); a drain restarted under the same fault publishes
nothing, stands by saying why (stderr, ``drain status``, ``drain check``) and exits 6; once healed
a drain forwards everything. Counted: lost 0, each job at most twice.

And one row the table refuses (a foreign key from an app's table to its job_id): parked, the rest
forwarded, the drain never exits; a restarted drain does not publish it again.
"""

from __future__ import annotations

import collections
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from drain import cli
from tests.support import configs, faultload, ledger, processes, rabbit, roles
from tests.support.waiting import wait_until

BACKEND = "events"
COMMITTED = 40
BATCH = 10
SETTLE_TIMEOUT_S = 2.0
EXIT_DEADLINE_S = 60.0
READ_ONLY = "options=-c%20default_transaction_read_only%3Don"
TRIGGER = """
CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'refusing to delete staged job %', OLD.job_id; END $$;
CREATE TRIGGER refuse_delete BEFORE DELETE ON staged_jobs FOR EACH ROW EXECUTE FUNCTION refuse_delete();
"""
SKIP = """
CREATE FUNCTION skip_delete() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
CREATE TRIGGER skip_delete BEFORE DELETE ON staged_jobs FOR EACH ROW EXECUTE FUNCTION skip_delete();
"""
# fault: (injected while leading, healed, the standby's reason code, words of the leader's
# reason, words of the standby's)
FAULTS = {
    "read_only": ("", "", "read_only", "read-only", "read-only"),
    "no_delete": ("REVOKE DELETE ON staged_jobs FROM {role}", "GRANT DELETE ON staged_jobs TO {role}",
                  "privileges", "permission denied", "lacks DELETE"),
    "trigger": (TRIGGER, "DROP TRIGGER refuse_delete ON staged_jobs", "delete_fails", "refusing to delete",
                "refusing to delete"),
    "skip": (SKIP, "DROP TRIGGER skip_delete ON staged_jobs", "delete_fails", "without an error",
             "without an error"),
}  # fmt: skip


@pytest.fixture(autouse=True)
def _need_broker() -> None:
    rabbit.need_rabbitmq()


@pytest.fixture
def role(database: str) -> Iterator[str]:
    """A login role of this test's own with the drain's grants (docs "Database setup")."""
    with roles.drain_role(database, prefix="drain_settle") as dsn:
        yield roles.user_of(dsn)


def exits_cannot_settle(drain: processes.Process) -> str:
    """Wait for the drain to give up; return its output (stderr and stdout)."""
    try:
        code = drain.wait(EXIT_DEADLINE_S)
    finally:
        drain.stop()
    output = drain.output()
    assert code == cli.EXIT_CANNOT_SETTLE, f"exit {code}, wanted {cli.EXIT_CANNOT_SETTLE}:\n{output[-3000:]}"
    return output


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_drain_that_cannot_settle_publishes_each_job_at_most_twice(
    fault: str, database: str, role: str, tmp_path: Path
) -> None:
    inject, heal, reason, leader_words, words = FAULTS[fault]
    dsn = re.sub(r"postgresql://[^@]+@", f"postgresql://{role}@", database)
    faulty = f"{dsn}?{READ_ONLY}" if fault == "read_only" else dsn
    backends = {BACKEND: configs.rabbitmq(rabbit.SHARED_URL)}
    settings = {"batch_size": BATCH, "settle_timeout_s": SETTLE_TIMEOUT_S}
    config = configs.write_config(tmp_path / "faulty.toml", faulty, backends, **settings)
    queue = rabbit.unique_name(f"settle-{fault}")
    counted: collections.Counter[str] = collections.Counter()
    with rabbit.queues(rabbit.SHARED_URL, queue):
        committed = rabbit.stage_jobs(database, COMMITTED, (queue,), BACKEND)

        # 1. The fault begins while the drain leads: it has published its first batch.
        failpoints = "" if fault == "read_only" else "after_publish=stop@1"
        began = time.monotonic()
        first = processes.start_drain(config, None, tmp_path / "first.log", failpoints=failpoints)
        if inject:
            wait_until("the drain to publish its first batch", first.stopped, EXIT_DEADLINE_S)
            roles.execute(database, inject.format(role=role))
            began = time.monotonic()
            first.signal(signal.SIGCONT)
        said = exits_cannot_settle(first)
        exit_after_s = time.monotonic() - began
        assert leader_words in said and "exiting" in said, said[-3000:]
        counted += rabbit.take_counts(rabbit.SHARED_URL, (queue,))

        # 2. Restarted under the same fault: it says why, publishes nothing, exits 6 again.
        status = processes.status(config, faulty)
        assert status["can_lead"] is False and status["cannot_lead"][0]["reason"] == reason, status
        check = processes.drain_cli("check", "--config", str(config), dsn=faulty)
        assert check.returncode == cli.EXIT_CHECK_FAILED and words in check.stderr, check.stderr
        second = processes.start_drain(config, None, tmp_path / "second.log")
        said = exits_cannot_settle(second)
        assert "standing by: " in said and words in said, said[-3000:]
        again = rabbit.take_counts(rabbit.SHARED_URL, (queue,))
        assert not again, f"a drain restarted under the fault published {sum(again.values())} messages"

        # 3. Healed: a drain forwards everything.
        if heal:
            roles.execute(database, heal.format(role=role))
        healthy = configs.write_config(tmp_path / "healthy.toml", dsn, backends, **settings)
        third = processes.start_drain(healthy, None, tmp_path / "third.log")
        with processes.running(third):
            ledger.wait_drained(database)
        counted += rabbit.take_counts(rabbit.SHARED_URL, (queue,))

    tally = ledger.Tally(
        committed={uuid.UUID(i) for i in committed},
        delivered=collections.Counter({uuid.UUID(i): n for i, n in counted.items()}),
        remaining=rabbit.staged_count(database),
    )
    faultload.report(
        f"cannot settle: {fault}",
        tally,
        exits=cli.EXIT_CANNOT_SETTLE,
        exit_after_s=f"{exit_after_s:.2f}",
        settle_timeout_s=SETTLE_TIMEOUT_S,
    )
    tally.check()
    assert tally.max_runs <= 2, f"a job was published {tally.max_runs} times: {tally}"


@pytest.mark.slow
def test_one_row_the_table_refuses_is_parked_and_the_rest_are_forwarded(
    database: str, role: str, tmp_path: Path
) -> None:
    dsn = re.sub(r"postgresql://[^@]+@", f"postgresql://{role}@", database)
    backends = {BACKEND: configs.rabbitmq(rabbit.SHARED_URL)}
    settings = {"batch_size": BATCH, "settle_timeout_s": SETTLE_TIMEOUT_S}
    config = configs.write_config(tmp_path / "drain.toml", dsn, backends, **settings)
    queue = rabbit.unique_name("settle-refused-row")
    counted: collections.Counter[str] = collections.Counter()
    with rabbit.queues(rabbit.SHARED_URL, queue):
        committed = rabbit.stage_jobs(database, COMMITTED, (queue,), BACKEND)
        refused = sorted(committed)[COMMITTED // 2]
        roles.execute(  # an app's row that still needs that job: its DELETE is refused, the others' not
            database,
            "CREATE TABLE app_refs (job_id uuid REFERENCES staged_jobs (job_id) ON DELETE RESTRICT); "
            f"INSERT INTO app_refs VALUES ('{refused}')",
        )
        for name in ("first", "restarted"):  # a restarted drain does not publish the parked row again
            drain = processes.start_drain(config, None, tmp_path / f"{name}.log")
            with processes.running(drain):
                wait_until("the rest", lambda: rabbit.staged_count(database) == 1, EXIT_DEADLINE_S)
                with pytest.raises(subprocess.TimeoutExpired):  # it does not exit (cannot settle)
                    drain.wait(2 * SETTLE_TIMEOUT_S)
            counted += rabbit.take_counts(rabbit.SHARED_URL, (queue,))
            if name == "first":
                assert "parked" in drain.output() and "app_refs" in drain.output(), drain.output()[-3000:]
        assert processes.status(config, dsn)["parked"] == 1
        roles.execute(database, "DROP TABLE app_refs")  # the app lets go; the operator deletes the row
        roles.execute(database, f"DELETE FROM staged_jobs WHERE job_id = '{refused}'")

    tally = ledger.Tally(
        committed={uuid.UUID(i) for i in committed},
        delivered=collections.Counter({uuid.UUID(i): n for i, n in counted.items()}),
        remaining=rabbit.staged_count(database),
    )
    faultload.report("cannot settle: one row refused (foreign key)", tally)
    tally.check()
    assert tally.max_runs == 1, f"a job was published {tally.max_runs} times: {tally}"
