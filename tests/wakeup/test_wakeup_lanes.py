"""The wake-up with lanes (issue 39): every idle member sleeps until a commit wakes it.

Without wake slots one member slept holding the table's one wake lock and every other idle
member found it taken and polled (0.1 s apart at most): a row of their lanes waited for the poll.
`drain migrate` now gives a table with lanes a wake slot per lane (up to MAX_WAKE_SLOTS); each
idle member takes one, every producer's INSERT probes them all, and a commit wakes every sleeper.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

import drain
from drain import config
from drain.relay import wakeup
from drain.store import connection, migrations, sql
from drain.store import session as store
from tests.support import configs, processes
from tests.support.waiting import wait_until

LANES = 3


def queued(redis_url: str, queue: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.llen(f"rq:queue:{queue}"))
    finally:
        client.close()


def migrated(database: str, lanes: int) -> config.Settings:
    settings = config.Settings(dsn=database, lanes=lanes)
    db = store.Store(settings)
    try:
        db.migrate()
    finally:
        db.close()
    return settings


@pytest.fixture
def members(database: str) -> Iterator[list[store.Store]]:
    """Four member sessions of a table migrated with three lanes."""
    settings = migrated(database, LANES)
    sessions = [store.Store(settings) for _ in range(LANES + 1)]
    try:
        yield sessions
    finally:
        for each in sessions:
            each.close()


def sleeping_members(dsn: str, table: str = "staged_jobs") -> set[int]:
    """The backends holding one of the table's wake slots (an armed, sleeping member), in this database."""
    with psycopg.connect(dsn) as conn:
        keys = [
            connection.split_key(int(row[0]))
            for row in conn.execute(
                "SELECT hashtextextended(%s, slot) FROM generate_series(0, %s - 1) AS slot",
                (f"drain-wake:public.{table}", migrations.MAX_WAKE_SLOTS),
            ).fetchall()
        ]
        rows = conn.execute(
            "SELECT pid, classid::bigint, objid::bigint FROM pg_locks WHERE locktype = 'advisory'"
            " AND granted AND mode = 'ExclusiveLock' AND objsubid = 1"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
    return {int(pid) for pid, classid, objid in rows if (classid, objid) in keys}


def test_migrate_gives_a_table_with_lanes_a_wake_slot_per_lane_never_fewer(database: str) -> None:
    one = store.Store(config.Settings(dsn=database))
    try:
        assert one.wake_trigger() == (True, 1), "a table without lanes keeps drain_wake_v1's one lock"
        migrated(database, 4)
        assert one.wake_trigger() == (True, 4)
        migrated(database, 1)  # another config's migration (Django's, a CI job's)
        assert one.wake_trigger() == (True, 4), "a migration with fewer lanes left members unwoken"
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute("ALTER TABLE staged_jobs DISABLE TRIGGER drain_wake")
        migrated(database, 64)
        assert one.wake_trigger() == (False, migrations.MAX_WAKE_SLOTS), (
            "re-enabled an operator's disabled trigger"
        )
        with psycopg.connect(database) as conn:
            definitions = [
                str(row[0])
                for row in conn.execute(
                    "SELECT pg_get_triggerdef(oid) FROM pg_trigger"
                    " WHERE tgname IN ('drain_wake', 'drain_wake_due')"
                )
            ]
        assert len(definitions) == 2
        assert all(f"drain_wake_v2('{migrations.MAX_WAKE_SLOTS}')" in each for each in definitions)
        assert any("UPDATE OF run_at, last_error" in each for each in definitions)
    finally:
        one.close()


def test_every_idle_member_sleeps_and_one_commit_wakes_them_all(members: list[store.Store]) -> None:
    channels = set()
    for member in members[:LANES]:
        armed, channel = member.wake_arm(LANES)
        assert armed, "an idle member could not sleep armed"
        member.listen(channel)
        channels.add(channel)
    assert len(channels) == 1
    assert not members[LANES].wake_arm(LANES)[0], "more members than slots: the last one polls"
    with psycopg.connect(members[0].settings.dsn) as producer:
        drain.stage(producer, "app.t")
    for member in members[:LANES]:
        assert member.wait_notified(5.0) == 1, "a sleeping member was not woken"
    for member in members[:LANES]:
        member.wake_disarm()
    with psycopg.connect(members[0].settings.dsn) as producer:
        drain.stage(producer, "app.t")
    assert all(member.wait_notified(0.3) == 0 for member in members[:LANES]), "notified while all were awake"


def test_no_member_arms_past_a_producer_that_probed(members: list[store.Store]) -> None:
    """The race of the one wake lock, for every slot: a producer that staged while a member slept
    holds every other slot shared until it ends, so no other member arms and sleeps past its commit."""
    first, second = members[0], members[1]
    assert first.wake_arm(LANES)[0]
    with psycopg.connect(first.settings.dsn) as producer:
        drain.stage(producer, "app.t")
        assert not second.wake_arm(LANES)[0], "armed past an open producer"
    assert second.wake_arm(LANES)[0], "the producer committed: a slot is free again"


def test_without_slots_a_second_member_cannot_sleep_and_is_told_to_migrate(database: str) -> None:
    settings = config.Settings(dsn=database, lanes=LANES)  # the table was migrated without lanes
    first, second = store.Store(settings), store.Store(settings)
    try:
        assert first.wake_arm(second.wake_trigger()[1])[0]
        assert not second.wake_arm(second.wake_trigger()[1])[0]
        warning = wakeup.trigger_warning(second)
        assert warning is not None and "1 wake slot(s)" in warning and "drain migrate" in warning
        assert wakeup.trigger_warning(store.Store(dataclasses.replace(settings, lanes=1))) is None
    finally:
        first.close()
        second.close()


def test_idle_drain_processes_with_lanes_all_sleep_armed(
    database: str, redis_db: str, tmp_path: Path
) -> None:
    """Three `drain run` members, idle: each holds a wake slot (none polls), and the jobs a
    producer then commits, in every lane, reach the broker."""
    migrated(database, LANES)
    cfg = configs.write_config(
        tmp_path / "drain.toml",
        database,
        {"default": configs.rq(redis_db, allowed_jobs=["tests.support.tasks.record"])},
        lanes=LANES,
        standby_retry_s=0.5,
    )
    started = [processes.start_drain(cfg, None, tmp_path / f"drain{i}.log") for i in range(LANES)]
    with processes.running(*started):

        def balanced() -> bool:
            done = processes.drain_cli("status", "--json", "--config", str(cfg), dsn=database)
            laned = json.loads(done.stdout)["lanes"]
            return isinstance(laned, dict) and sorted(len(m["led"]) for m in laned["members"]) == [1, 1, 1]

        wait_until("three members with a lane each", balanced, 60)

        def all_asleep() -> bool:
            return len(sleeping_members(database)) == LANES

        wait_until("every idle member asleep on a wake slot of its own", all_asleep, 30)
        with psycopg.connect(database) as producer:
            for n in range(60):
                drain.stage(producer, "tests.support.tasks.record", args=[n], queue="lanes")

        def forwarded() -> bool:
            return queued(redis_db, "lanes") == 60

        wait_until("every job at the broker", forwarded, 30)
        wait_until("every member asleep again", all_asleep, 30)


def test_an_apps_delete_wakes_the_sleepers_and_the_drains_own_delete_does_not(
    members: list[store.Store],
) -> None:
    """Deleting the row ahead of a keyed row frees the rows behind it: an app's DELETE wakes the
    sleeping members. The drain's settlement (delete_ids) neither notifies nor holds a wake slot
    shared, which would keep other idle members from arming while it forwards."""
    sleeper, dsn = members[0], members[0].settings.dsn
    armed, channel = sleeper.wake_arm(LANES)
    assert armed
    sleeper.listen(channel)
    with psycopg.connect(dsn) as producer:
        first, second = (drain.stage(producer, "app.t") for _ in range(2))
    assert sleeper.wait_notified(5.0) == 1
    with psycopg.connect(dsn) as app:
        app.execute("DELETE FROM staged_jobs WHERE job_id = %s", (first,))
    assert sleeper.wait_notified(5.0) == 1, "an app's DELETE did not wake the sleeping member"
    with psycopg.connect(dsn) as settling:
        row = settling.execute("SELECT id FROM staged_jobs WHERE job_id = %s", (second,)).fetchone()
        assert row is not None
        deleted = settling.execute(
            sql.query("delete_ids", sql.Names("public", "staged_jobs")),
            {"ids": [row[0]], "job_ids": [second]},
        )
        assert deleted.rowcount == 1
        held = settling.execute(
            "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'"
        ).fetchone()
        assert held == (0,), "the drain's own DELETE probed the wake slots"
    assert sleeper.wait_notified(0.5) == 0, "the drain's own DELETE woke a sleeping member"
