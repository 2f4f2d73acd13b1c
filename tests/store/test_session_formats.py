"""The drain reads rows in the formats it sets for its own session, whatever a role or a database
chose (red team 26): a DateStyle psycopg cannot read timestamptz in made every batch raise
NotImplementedError (a crash loop that `drain check` called ok); a LATIN1 client_encoding made one
row holding a character LATIN1 lacks fail every select (the rows behind it never went)."""

from __future__ import annotations

import dataclasses

import psycopg
import pytest
from psycopg import sql

import drain
from drain import config, testing
from tests.conftest import ManualClock
from tests.support import relays, roles

ROLE_SETTINGS = {
    "datestyle": "SQL, DMY",
    "client_encoding": "LATIN1",
    "intervalstyle": "iso_8601",
}


@pytest.mark.parametrize("setting", list(ROLE_SETTINGS))
def test_a_roles_session_formats_neither_stop_nor_block_the_drain(
    setting: str, settings: config.Settings, database: str, clock: ManualClock
) -> None:
    with roles.drain_role(database, insert=True, prefix="drain_formats") as dsn:
        with psycopg.connect(database, autocommit=True) as admin:
            admin.execute(
                sql.SQL("ALTER ROLE {} SET {} = {}").format(
                    sql.Identifier(roles.user_of(dsn)),
                    sql.Identifier(setting),
                    sql.Literal(ROLE_SETTINGS[setting]),
                )
            )
        with psycopg.connect(database) as app:
            drain.stage(app, "app.tasks.greet", args=["山田太郎"])
            for n in range(5):
                drain.stage(app, "app.tasks.plain", args=[n])
        memory = testing.MemoryAdapter("default")
        the_relay = relays.leading(dataclasses.replace(settings, dsn=dsn), {"default": memory}, clock)
        try:
            for _ in range(5):
                the_relay.drain_once()
                if len(memory.published) == 6:
                    break
        finally:
            the_relay.shutdown()
        assert (
            sorted(job.job_name for job in memory.published) == ["app.tasks.greet"] + ["app.tasks.plain"] * 5
        )
        (greeted,) = [job for job in memory.published if job.job_name == "app.tasks.greet"]
        assert list(greeted.args) == ["山田太郎"]
        with psycopg.connect(database) as check:
            row = check.execute("SELECT count(*) FROM staged_jobs").fetchone()
        assert row == (0,)
