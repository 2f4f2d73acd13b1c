"""Red team, round two: the console's text filters against what its pages show, and its
confirmation against the set it counted. Each test here reproduces a finding (xfail, strict)."""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path

import psycopg
import pytest

from drain.observability import redaction
from drain.store import admin
from drain.store import session as store
from tests.support import console

pytest.importorskip("drain.console.app")
from drain.console import forms, text


def _bury(db: store.Store, **row: object) -> int:
    with psycopg.connect(db.settings.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs_dead")
    (dead_id,) = console.bury(db.settings.dsn, [{"job_name": "mail.send", **row}])
    return dead_id


def _found(db: store.Store, **terms: str) -> int:
    queries = admin.Admin(db.conn, db.names)
    return queries.dead_matching(admin.DeadFilter(limit=100, **terms), 1_000, 20_000).matching  # type: ignore[arg-type]


def _page_error(db: store.Store) -> str:
    (row,) = admin.Admin(db.conn, db.names).dead_page(admin.DeadFilter(limit=10), 10_000, 100_000)
    return text.error(row["error"])


@pytest.mark.parametrize(
    "error",
    [
        pytest.param("connect failed: pa\u017f\u017fword=hunter2222 host=db", id="long-s-both"),
        pytest.param("connect failed: PA\u017fSWORD=hunter2222", id="long-s-upper"),
        pytest.param("login: pa\u017f\u017fword = 'hunter2222 x'", id="long-s-quoted"),
    ],
)
def test_the_error_filter_finds_a_password_a_long_s_pair_masks(db: store.Store, error: str) -> None:
    """The error filter searches what a page shows (docs/operations/console.md: "A filter
    searches exactly what the pages show"). The page masks the pair's value (redaction.redact:
    re.IGNORECASE matches ſ to s), but the filter finds it: one term a letter at a time, a
    read-only visitor spells the password out by the match count."""
    _bury(db, error=error)
    shown = _page_error(db)
    assert "hunter2222" not in shown and "***" in shown  # the page masks it
    assert _found(db, error="connect") + _found(db, error="login") == 1  # the row is there
    assert _found(db, error="hunter2222") == 0, "the error filter found the password the page masks"
    assert _found(db, error="hunter") == 0


def test_a_page_never_shows_the_consoles_own_secret_as_a_number() -> None:
    """docs/operations/console.md ("What a page never does"): in arguments, "the console's own
    secrets ... are ***". A DSN password of digits (its fragments are hidden, redaction.hide)
    that an argument holds as a number is shown on the list and on the dead letter's page."""
    before = redaction.hidden()
    redaction.hide(["73918264"])  # the console's DSN's password, as `drain console` hides it
    try:
        assert "73918264" not in text.pretty({"note": "73918264"})  # a string's: hidden
        assert "73918264" not in text.pretty({"pin": 73918264}), "the page shows the console's own secret"
        assert "73918264" not in text.brief([73918264])
    finally:
        redaction.hide(before)


def _hidden_form(body: str) -> list[tuple[str, str]]:
    return re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', body)


@pytest.mark.xfail(
    strict=True,
    reason="forms.action turns a posted `confirmed` without `digest` into a plain count: the act "
    "then takes any set of as many, though the confirmation's own form carried the digest of the "
    "set it counted (a digest changed matches none; a digest dropped matches any of that size)",
)
def test_an_act_with_the_confirmations_digest_dropped_takes_no_other_set(
    database: str, tmp_path: Path
) -> None:
    (first,) = console.bury(database, [{"job_name": "mail.send", "error": "A"}])
    with psycopg.connect(database) as slow:  # numbered below B's, committed after the count
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
            form = _hidden_form(confirm.body)
            assert {name for name, _ in form} >= {"confirmed", "digest", "upto"}
            with psycopg.connect(database, autocommit=True) as other:  # another operator purges A
                other.execute("DELETE FROM staged_jobs_dead WHERE dead_id = %s", (first,))
            done = site.post("/dead/act", [(name, value) for name, value in form if name != "digest"])
    assert done.status == 200
    assert "The set changed since the confirmation: confirm again." in done.body
    assert console.count(database) == 2  # C, never counted, was not purged


def test_forms_action_reads_the_confirmed_count_without_a_digest_as_a_plain_count() -> None:
    """The unit under the finding above (passes: it pins what forms.action does today)."""
    chosen = forms.action({"action": "purge", "job_name": "x", "confirmed": "2"})
    assert chosen.confirmed == 2 and not isinstance(chosen.confirmed, admin.Counted)


def test_the_arguments_filter_decides_a_row_in_bounded_time(db: store.Store) -> None:
    """docs/operations/console.md ("What it costs"): rows decided in Python "under 0.1 ms each",
    the whole walk bounded by the statement_timeout. An app's argument of 72 KB ("a://b:"
    repeated, no "@": a URL-looking value from a user's input) is one candidate for any term it
    holds (a://b); masking it takes seconds (1 MB: about half an hour), the console's thread busy,
    whatever the timeout. The dead letter's own page masks it whole too."""
    _bury(db, kwargs={"note": "a://b:" * 12_000})
    queries = admin.Admin(db.conn, db.names)
    queries.limit_statements(1_000)
    started = time.monotonic()
    with contextlib.suppress(psycopg.errors.QueryCanceled):
        queries.dead_matching(admin.DeadFilter(limit=100, arg="a://b"), 1_000, 20_000)
    assert time.monotonic() - started < 2.5, "one row's masking ran past the 1 s statement_timeout"


@pytest.mark.parametrize("field", ["ordering_key", "job_name", "queue"])
def test_a_page_never_shows_a_urls_password_in_a_name(database: str, tmp_path: Path, field: str) -> None:
    """docs/operations/console.md ("What a page never does"): "Show a DSN or a secret". A key
    derived from a connection (an ordering key per tenant database, say) holds its URL."""
    (dead_id,) = console.bury(database, [{field: "postgres://app:hunter2222@db.example/tenant"}])
    with console.running(database, tmp_path) as site:
        site.sign_in()
        listed, one = site.get("/dead"), site.get(f"/dead/{dead_id}")
    assert listed.status == 200 and one.status == 200
    assert "db.example" in one.body
    assert "hunter2222" not in one.body and "hunter2222" not in listed.body


def test_the_list_never_shows_a_prefix_of_the_consoles_own_secret(db: store.Store) -> None:
    """docs/operations/console.md: in errors, "the console's own secrets, each hidden before a
    list cuts the error". The list shows 14 of the DSN password's 15 characters."""
    secret = "Sup3rDbPassw0rd"
    before = redaction.hidden()
    redaction.hide([secret])  # as `drain console` hides its DSN's password fragments
    try:
        _bury(db, error="pa\u017f\u017fword=" + "A" * 1_196 + " " + secret + " at login")
        (row,) = admin.Admin(db.conn, db.names).dead_page(admin.DeadFilter(limit=10), text.FIELD_CHARS, 4096)
        shown = text.error(row["error"])
        assert "A" * 10 not in shown  # the pair's value is masked
        assert secret[:6] not in shown, f"the list shows a prefix of the console's own secret: {shown!r}"
    finally:
        redaction.hide(before)


@pytest.mark.xfail(
    strict=True,
    reason="redaction.masked hides a URL password's fragments only within the string that holds "
    "the URL (redact_url), not in the key's value or a sibling string: the same password, quoted "
    "bare next to its URL, is shown",
)
@pytest.mark.parametrize(
    "value",
    [
        pytest.param({"postgres://app:hunter2222@db/x": "hunter2222"}, id="keyed-by-url"),
        pytest.param(["postgres://app:hunter2222@db/x", "retried with hunter2222"], id="sibling"),
    ],
)
def test_a_page_never_shows_a_masked_urls_password_beside_it(value: object) -> None:
    """Lower severity: the promise's letter is "the password of every URL in a string"; within one
    string (``"postgres://app:hunter2222@db/x then hunter2222"``) the repeat is hidden."""
    assert "hunter2222" not in text.pretty(value)


def test_a_walk_fetches_no_more_than_check_bytes_of_arguments(
    db: store.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/operations/console.md ("What it costs"): a page's walk decides in Python "at most
    1,000 of them and 4 MB of their arguments", "so the console's memory stays bounded whatever
    the rows hold". 20 dead letters of 1 MB of repetitive arguments each (stored compressed, a
    small fraction of that) under a 2 MB bound: all 20 (20 MB) are fetched and masked in one walk."""
    with psycopg.connect(db.settings.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs_dead")
    console.bury(
        db.settings.dsn, [{"kwargs": {"token": "t", "note": "needle " + "ab" * 500_000}} for _ in range(20)]
    )
    fetched: list[int] = []
    shown = admin._arg_shown

    def counting(values: list[object], term: str) -> bool:
        fetched.append(sum(len(json.dumps(value)) for value in values))
        return shown(values, term)

    monkeypatch.setattr(admin, "_arg_shown", counting)
    admin.Admin(db.conn, db.names).dead_matching(
        admin.DeadFilter(limit=100, arg="needle"), 1_000, 20_000, check_bytes=2_000_000
    )
    assert len(fetched) > 1  # the first is decided whatever its size
    assert sum(fetched[:-1]) < 2_000_000, (
        f"{len(fetched)} rows, {sum(fetched):,} bytes fetched under a 2 MB bound"
    )
