"""Red team (console): an action against the dead letters its confirmation counted. The first
test is a finding (marked xfail, strict, until the product was fixed): it states the promised
behaviour. The second pins the console's side of the fix: the confirmation's form carries the
digest of the set it counted."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import psycopg
import pytest

from drain.store import admin
from drain.store import session as store
from tests.support import console

pytest.importorskip("drain.console.app")


def _errors(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [str(row[0]) for row in conn.execute("SELECT error FROM staged_jobs_dead ORDER BY dead_id")]


@pytest.mark.parametrize("term", [None, "needle"], ids=["job-name", "error-text"])
def test_an_action_takes_no_dead_letter_swapped_in_after_its_count(db: store.Store, term: str | None) -> None:
    """The docs: "another command may have retried or purged some meanwhile. The page then says
    'Nothing done: N dead letter(s) match now, the confirmation counted M. The set changed since
    the confirmation: confirm again.'" The confirmation carries two things, ``upto`` and the
    count, and neither names the set: the confirmation counts A and B (2, upto B); a burial
    numbered before B commits C after the count (a leader's pipelined batches); another operator
    purges A (`drain dead purge`). At the act, B and C match: 2, as confirmed, so the act purges
    C, which no confirmation counted, and says "2 dead letter(s) purged"."""
    dsn = db.settings.dsn
    queries = admin.Admin(db.conn, db.names)
    chosen = admin.DeadFilter(job_name="mail.send", error=term)
    (first,) = console.bury(dsn, [{"job_name": "mail.send", "error": "A needle"}])
    with psycopg.connect(dsn) as slow:  # a burial numbered before B, committed after the count
        slow.execute(
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
            " options, created_at, attempts, error, dead_at) VALUES (7, 'mail.send', '[]', '{}',"
            " 'default', 'default', gen_random_uuid(), '{}', now(), 3, 'C needle', now())"
        )
        console.bury(dsn, [{"job_name": "mail.send", "error": "B needle"}])
        db.conn.commit()
        confirmed, upto = queries.dead_extent(chosen)
        db.conn.commit()
        slow.commit()
    assert confirmed == 2
    assert queries.dead_purge(admin.DeadFilter(ids=[first])).done == 1  # another operator, meanwhile
    db.conn.commit()
    acted = queries.dead_purge(dataclasses.replace(chosen, upto=upto), confirmed)
    left = _errors(dsn)
    assert "C needle" in left, f"the act purged C, which the confirmation never counted: {acted}"
    assert acted.changed is not None


@pytest.mark.parametrize("posted", ["as-confirmed", "swapped", "tampered"])
def test_the_console_acts_on_the_set_its_confirmation_counted(
    database: str, tmp_path: Path, posted: str
) -> None:
    """End to end: the confirmation's form carries the digest of the set it counted, and the act
    takes that set or none. "swapped": one counted dead letter goes and one numbered below the
    bound commits after the count (as many as confirmed: 2); "tampered": the posted digest is
    changed. Either way nothing is done and the page says the set changed."""
    (first,) = console.bury(database, [{"job_name": "mail.send", "error": "A"}])
    with psycopg.connect(database) as slow:  # a burial numbered before B, committed after the count
        if posted == "swapped":
            slow.execute(
                "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
                " options, created_at, attempts, error, dead_at) VALUES (7, 'mail.send', '[]', '{}',"
                " 'default', 'default', gen_random_uuid(), '{}', now(), 3, 'C', now())"
            )
        console.bury(database, [{"job_name": "mail.send", "error": "B"}])
        with console.running(database, tmp_path) as site:
            site.sign_in()
            confirm = site.post(
                "/dead/confirm", {"csrf": site.csrf(), "action": "purge", "job_name": "mail.send"}
            )
            slow.commit()
            assert confirm.status == 200 and "Purge 2 dead letter(s)?" in confirm.body
            form = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirm.body)
            (digest,) = [value for name, value in form if name == "digest"]
            assert re.fullmatch("[0-9a-f]{64}", digest)
            if posted == "swapped":
                with psycopg.connect(database, autocommit=True) as other:  # another operator
                    other.execute("DELETE FROM staged_jobs_dead WHERE dead_id = %s", (first,))
            if posted == "tampered":
                form = [(name, "0" * 64 if name == "digest" else value) for name, value in form]
            done = site.post("/dead/act", form)
    assert done.status == 200
    if posted == "as-confirmed":
        assert "2 dead letter(s) purged." in done.body and console.count(database) == 0
        return
    assert "The set changed since the confirmation: confirm again." in done.body
    assert "as many as the confirmation counted, but not the same ones" in done.body
    assert console.count(database) == 2
