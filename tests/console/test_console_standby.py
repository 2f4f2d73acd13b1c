"""The console on a hot standby: it reads what the primary committed and refuses to act, saying
why, whatever the credential (a private primary and its streaming standby)."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from tests.support import console, postgres
from tests.support.waiting import wait_until

DATABASE = "drain_console"


def dead_on(dsn: str) -> int:
    with psycopg.connect(dsn, connect_timeout=3) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs_dead").fetchone()
    return int(row[0]) if row else 0


@pytest.mark.slow
def test_on_a_standby_it_reads_and_refuses_to_act(tmp_path: Path) -> None:
    if not postgres.available():
        pytest.skip("PostgreSQL server binaries are not installed")
    pair = postgres.StreamingPair()
    try:
        primary = pair.primary.migrated_database(DATABASE)
        console.bury(primary, [{"job_name": "mail.send"}, {"job_name": "mail.send"}])
        standby = pair.standby.dsn(DATABASE)
        pair.replicated(DATABASE)
        wait_until("the dead letters on the standby", lambda: dead_on(standby) == 2, 30)
        with console.running(standby, tmp_path) as site:
            site.sign_in()
            page = site.get("/dead").body
            assert "the database is a standby" in page and 'id="retry-all"' not in page
            assert "<strong>2</strong> dead letter(s) match" in page
            refused = site.post(
                "/dead/act", {"csrf": site.csrf(), "action": "purge", "job_name": "mail.send"}
            )
            assert refused.status == 409 and "the database is a standby" in refused.body
            assert site.get("/").status == 200
        assert dead_on(primary) == 2
    finally:
        pair.stop()
