"""The console's dead-letter filters and actions against what its pages show and its confirmation
counts: a filter must not find what a page masks, an action's form must not crash the console, and
a button must not name a count the confirmation will not act on."""

from __future__ import annotations

import dataclasses
import json
import re
import types
import urllib.parse
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from drain import config
from drain.observability import redaction
from drain.store import admin
from drain.store import session as store
from tests.support import console

pytest.importorskip("drain.console.app")
from drain.console import forms, text

NEEDLE = "zq7needle"


def _bury_kwargs(db: store.Store, kwargs: object) -> int:
    with psycopg.connect(db.settings.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs_dead")
    (dead_id,) = console.bury(db.settings.dsn, [{"job_name": "mail.send", "kwargs": kwargs}])
    return dead_id


def _found(db: store.Store, **terms: str) -> int:
    walk = admin.Admin(db.conn, db.names).dead_matching(admin.DeadFilter(limit=100, **terms), 1_000, 20_000)  # type: ignore[arg-type]
    return walk.matching


def _shown_kwargs(db: store.Store) -> str:
    (row,) = admin.Admin(db.conn, db.names).dead_list(admin.DeadFilter())
    return text.pretty(row["job_kwargs"])


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("pa\u017f\u017fword", id="long-s"),
        pytest.param("\u017fecret", id="long-s-secret"),
        pytest.param("api_\u212aey", id="kelvin-sign"),
        pytest.param("credent\u0131al", id="dotless-i"),
        pytest.param("credent\u0130al", id="dotted-capital-i"),
    ],
)
def test_a_secret_named_key_with_a_letter_python_folds_is_not_searched(db: store.Store, key: str) -> None:
    """Python's re.IGNORECASE folds U+017F (long s) to s, U+212A (Kelvin sign) to k and U+0130 /
    U+0131 to i; Postgres's ~* does not. So the page masks ``{"paſſword": ...}`` (is_secret_name)
    while the arguments filter, whose walk asks Postgres whether a key is secret-named, searches
    its value: a read-only visitor spells the value out one letter at a time by the match count."""
    _bury_kwargs(db, {key: NEEDLE})
    assert NEEDLE not in _shown_kwargs(db)  # the page masks it
    assert _found(db, arg=NEEDLE) == 0, "the filter found the value the page masks"
    assert _found(db, arg=key) == 1  # the key itself is shown, and found


_FOLDS = {"s": "s\u017f", "k": "k\u212a", "i": "i\u0131\u0130"}
_WORDS = ["password", "passwd", "secret", "token", "credential", "auth", "cookie", "api_key", "apiKey", "key"]


@st.composite
def _spellings(draw: st.DrawFn) -> str:
    """A secret name (or a near one), each letter in either case or as a letter Python folds to it."""
    word = draw(st.sampled_from(_WORDS))
    letters = [draw(st.sampled_from(sorted({c, c.upper(), *_FOLDS.get(c.lower(), "")}))) for c in word]
    before = draw(st.sampled_from(["", "x", "_", "my"]))
    return before + "".join(letters) + draw(st.sampled_from(["", "s", "_id"]))


@hsettings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=_spellings())
def test_no_key_the_page_masks_has_its_value_searched(db: store.Store, key: str) -> None:
    """Generated spellings of the secret names, with Unicode folds: a value the page masks is
    never found by the arguments filter, and one it shows is."""
    _bury_kwargs(db, {key: NEEDLE})
    if redaction.is_secret_name(key):
        assert _found(db, arg=NEEDLE) == 0, key
    else:
        assert _found(db, arg=NEEDLE) == 1, key


def test_the_folded_letters_are_all_python_folds_to_ascii() -> None:
    """redaction.FOLDED is every letter re.IGNORECASE matches to an ASCII letter (in the BMP,
    where all of them are)."""
    letter = re.compile("[a-z]", re.IGNORECASE)
    found = {chr(c) for c in range(128, 0x10000) if not 0xD800 <= c < 0xE000 and letter.fullmatch(chr(c))}
    assert found == set(redaction.FOLDED)
    assert all(re.fullmatch(ascii, fold, re.IGNORECASE) for fold, ascii in redaction.FOLDED.items())


@pytest.mark.parametrize(
    ("value", "piece"),
    [
        pytest.param("host=db password=my secretword user=x", "secretword", id="libpq-unquoted-spaces"),
        pytest.param("password=hunter2222 then hunter2222", "hunter2222", id="repeated-password"),
        pytest.param("https://user:pa ss%20word@db.example/x", "ss%20word", id="url-password-with-space"),
        pytest.param("https://db.example/x?pa\u017f\u017fword=hunter2222", "hunter2222", id="query-long-s"),
    ],
)
def test_the_arguments_filter_finds_no_piece_of_a_masked_string(
    db: store.Store, value: str, piece: str
) -> None:
    _bury_kwargs(db, {"note": value})
    assert piece not in _shown_kwargs(db)
    assert _found(db, arg=piece) == 0, "the filter found a piece of a password the page masks"


def test_the_error_filter_does_not_find_the_consoles_own_secrets(db: store.Store) -> None:
    """The page's errors go through redaction.redact, which also hides the console process's own
    secrets (redaction.hide: its DSN's password fragments); the error filter redacted in SQL with
    the two patterns only, so it found a dead letter whose error quotes the database password
    bare, and spelled it out by the match count. A term holding such a secret, or within one,
    matches nothing; the arguments filter alike."""
    secret = "Sup3rDbPassw0rd"
    with psycopg.connect(db.settings.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs_dead")
    console.bury(db.settings.dsn, [{"error": f"login failed, tried {secret} for app"}])
    redaction.hide([secret])
    try:
        (row,) = admin.Admin(db.conn, db.names).dead_list(admin.DeadFilter())
        assert secret not in text.error(row["error"])
        assert _found(db, error=secret[:8]) == 0, "the error filter found the hidden secret"
        assert _found(db, error="tried " + secret) == 0 and _found(db, error="SUP3RDB") == 0
        assert _found(db, error="login failed") == 1  # the rest is found
        _bury_kwargs(db, {"note": f"pw {secret}"})
        assert _found(db, arg=secret[2:9]) == 0 and _found(db, arg="pw") == 1
    finally:
        redaction.hide(())


@pytest.mark.parametrize("upto", ["\u00b2", "\u0663", "\uff11", "-1", "1e3", " 5"])
def test_a_tampered_upto_is_refused_not_a_crash(upto: str) -> None:
    """``upto`` was read with str.isdigit, which is true for '²' (int() then raises ValueError:
    the console answered 500) and for other scripts' digits ('٣', '１': read as 3 and 1). Refused
    as ``start`` is: an ASCII number."""
    with pytest.raises(forms.Refused) as refused:
        forms.action({"action": "purge", "upto": upto})
    assert refused.value.status == 400


def test_the_retry_all_button_names_no_window_count(database: str, tmp_path: Path) -> None:
    """With a text filter the page counts the matches among the newest 20,000 dead letters only,
    but "Retry all N matching" named that count while the confirmation (and the action) take
    every match: the button said 1, the confirmation 2. A button names a count only where it
    is the whole one."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
            " options, created_at, attempts, error, dead_at)"
            " SELECT n, 'tasks.send', '[]', '{}', 'default', 'default', gen_random_uuid(), '{}', now(), 3,"
            " CASE WHEN n IN (1, 25000) THEN 'needle broke' ELSE 'boom' END, now()"
            " FROM generate_series(1, 25000) AS n"
        )
    with console.running(database, tmp_path) as site:
        site.sign_in()
        page = site.get("/dead?" + urllib.parse.urlencode({"error": "needle"})).body
        assert 'id="onward"' in page  # the page read a window
        button = re.search(r'id="retry-all">([^<]*)<', page)
        assert button is not None
        confirm = site.post("/dead/confirm", {"csrf": site.csrf(), "action": "retry", "error": "needle"})
        assert "Retry 2 dead letter(s)?" in confirm.body
    assert "1 matching" not in button.group(1), f"the button says {button.group(1)!r}; the action takes 2"


def test_json_of_the_walk_and_the_page_agree_on_escapes(db: store.Store) -> None:
    """The cheap test looks for the term's JSON in the arguments' JSON text: quotes, backslashes,
    control characters and non-ASCII letters are each found as the page shows them."""
    values = ['say "hi"', "C:\\dir\\file", "tab\there", "stra\u00dfe", "\u1e9e", "caf\u0065\u0301", "50%_*"]
    _bury_kwargs(db, {"v": values})
    for value in values:
        assert _found(db, arg=value) == 1, value
        assert _found(db, arg=value[1:]) == 1, value
    assert json.dumps(values, ensure_ascii=False)  # the page shows them as they are


def test_the_confirmation_counts_under_the_actions_bound(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page stops at 1,000 matches and says the confirmation counts them all, "bounded by the
    drain's statement_timeout_s" (docs/operations/console.md), but the confirmation ran on a page's
    session (5 s): a count of every match that a page's bound cuts (the arguments filter over a few
    hundred thousand dead letters) left "retry all matching" with no confirmation at all, while the
    action itself may run that long. Here the page's bound is cut to 50 ms to show it on 30,000."""
    import threading

    import uvicorn

    from drain.console import app, figures
    from tests.support import faultload
    from tests.support.waiting import wait_until

    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
            " options, created_at, attempts, error, dead_at)"
            " SELECT g, 'j', jsonb_build_array(g),"
            " jsonb_build_object('user_id', g, 'note', repeat('x', 100)),"
            " 'default', 'default', gen_random_uuid(), '{}', now(), 1, 'e', now()"
            " FROM generate_series(1, 30000) g"
        )
    monkeypatch.setattr(figures, "PAGE_TIMEOUT_MS", 50)
    port = faultload.free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app.build(config.Settings(dsn=database, statement_timeout_s=60), token=console.TOKEN),
            port=port,
            log_config=None,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until("the console to listen", lambda: server.started, 30)
        site = console.Console(f"http://127.0.0.1:{port}", None)
        site.sign_in()
        confirm = site.post(
            "/dead/confirm", {"csrf": site.csrf("/login"), "action": "retry", "arg": "user_id"}
        )
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert confirm.status == 200 and "Retry 30,000 dead letter(s)?" in confirm.body, confirm.body[-400:]


@pytest.mark.parametrize("name", ["job_name", "error", "arg", "ordering_key"])
def test_a_nul_in_a_filter_is_refused_not_a_database_error(name: str) -> None:
    """``/dead?error=%00`` reached Postgres, which cannot hold a NUL in text: the page said
    "Database error (DataError)" (503), logged a warning and closed the session. No dead letter
    holds one: the filter is refused as a bad request."""
    with pytest.raises(forms.Refused) as refused:
        forms.filters({name: "a\x00b"})
    assert refused.value.status == 400


def test_an_action_takes_no_dead_letter_committed_after_its_count(db: store.Store) -> None:
    """upto bounds an action by dead_id, but dead_id is handed out at INSERT, not at commit: a
    dead letter numbered below upto whose burial commits after the count (two transactions
    burying at once: a leader's pipelined batches, `drain migrate` beside the leader) was acted
    on unconfirmed ("purged 2, the confirmation said 1"). The act carries the count it was
    confirmed for and, in its own statement, takes none when as many do not match."""
    dsn = db.settings.dsn
    queries = admin.Admin(db.conn, db.names)
    chosen = admin.DeadFilter(job_name="mail.send")
    with psycopg.connect(dsn) as slow:  # a burial numbered first, committed last
        slow.execute(
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
            " options, created_at, attempts, error, dead_at) VALUES (1, 'mail.send', '[]', '{}',"
            " 'default', 'default', gen_random_uuid(), '{}', now(), 3, 'the slow one', now())"
        )
        console.bury(dsn, [{"job_name": "mail.send", "error": "the quick one"}])
        db.conn.commit()
        confirmed, upto = queries.dead_extent(chosen)
        db.conn.commit()
        slow.commit()
    assert confirmed == 1
    purged = queries.dead_purge(dataclasses.replace(chosen, upto=upto), confirmed)
    assert purged.done <= confirmed, f"purged {purged.done}, the confirmation said {confirmed}"
    assert purged == admin.Acted(0, changed=2) and console.count(dsn) == 2
    retried = queries.dead_retry(dataclasses.replace(chosen, upto=upto), confirmed)
    assert retried == admin.Acted(0, changed=2) and console.count(dsn) == 2
    assert queries.dead_purge(dataclasses.replace(chosen, upto=upto), 2).done == 2


def test_the_page_says_the_set_changed_and_acts_on_none(database: str, tmp_path: Path) -> None:
    """A confirmation posted for a count that no longer matches is refused in one line, and
    nothing is touched."""
    console.bury(database, [{"job_name": "mail.send"}, {"job_name": "mail.send"}])
    with console.running(database, tmp_path) as site:
        site.sign_in()
        form = {"csrf": site.csrf(), "action": "purge", "job_name": "mail.send", "confirmed": "1"}
        done = site.post("/dead/act", form)
    assert done.status == 200 and "The set changed since the confirmation: confirm again." in done.body
    assert console.count(database) == 2


def test_an_upto_beyond_the_pages_start_does_not_widen_the_action() -> None:
    """A page of older dead letters (``start=5``) posts its filter with ``start``; the
    confirmation counts those numbered 5 and below and posts ``upto``. ``upto`` replaced
    ``start``: a form with upto=10 acted on dead letters above the start no count covered.
    The lower of the two bounds applies."""
    chosen = forms.action({"action": "purge", "start": "5", "upto": "10"}).chosen
    assert chosen.upto == 5
    assert forms.action({"action": "purge", "start": "5", "upto": "3"}).chosen.upto == 3
    assert forms.action({"action": "purge", "upto": "3"}).chosen.upto == 3


_ERROR_LETTERS = "aPsword=:/@ \t\n'\\*\u00df\u1e9e\u0130\u0131\u03a3\u03c3\u03c2e\u0301%_\u00a0"


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    error=st.text(alphabet=_ERROR_LETTERS, max_size=30).map(lambda body: "x://u:" + body),
    start=st.integers(0, 40),
    size=st.integers(1, 8),
)
def test_the_error_filters_cheap_test_skips_no_match(
    db: store.Store, error: str, start: int, size: int
) -> None:
    """The error filter's cheap test (the term in the stored error, any case) passes over a row
    only where the real one (the term in the redacted error, any case) cannot match: the filter
    finds what the real test alone finds, for terms cut from the error itself."""
    term = error[start : start + size].strip() or "x"
    with psycopg.connect(db.settings.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs_dead")
        params = admin.DeadFilter().params()
        (real,) = conn.execute(  # type: ignore[misc]
            "SELECT strpos(lower(regexp_replace(regexp_replace(%(error)s, %(url_password)s, %(url_mask)s,"
            " 'g'), %(pair_password)s, %(pair_mask)s, 'gi')), lower(%(term)s)) > 0",
            {**params, "error": error, "term": term},
        ).fetchone()
    console.bury(db.settings.dsn, [{"error": error}])
    assert _found(db, error=term) == int(real), (error, term)


_ARG_LETTERS = 'abc"\\\n\t\x01\x1f\u00e9\u00df\u1e9e\u0131\u0130/*%_\U0001f600\u2028e\u0301<>&'


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kwargs=st.dictionaries(
        st.text(alphabet=_ARG_LETTERS, min_size=1, max_size=8),
        st.text(alphabet=_ARG_LETTERS, max_size=12) | st.lists(st.text(alphabet=_ARG_LETTERS, max_size=6)),
        min_size=1,
        max_size=3,
    ),
    pick=st.data(),
)
def test_the_arguments_filters_cheap_test_skips_no_shown_piece(
    db: store.Store, kwargs: dict[str, object], pick: st.DataObject
) -> None:
    """Every piece of a key or of a string value the page shows (JSON escapes, quotes, backslashes,
    control characters, astral and combining letters) is found: the cheap test on the arguments'
    JSON text, the term escaped as JSON, passes over no row the walk would match."""
    shown = [key for key in kwargs] + [
        value for values in kwargs.values() for value in (values if isinstance(values, list) else [values])
    ]
    whole = pick.draw(st.sampled_from([piece for piece in shown if piece.strip()] or ["a"]))
    start = pick.draw(st.integers(0, max(len(whole) - 1, 0)))
    term = whole[start : start + pick.draw(st.integers(1, 6))].strip()
    if not term:
        return
    _bury_kwargs(db, kwargs)
    expected = int(any(term in piece for piece in shown))
    assert _found(db, arg=term) == expected, (kwargs, term)


@pytest.mark.parametrize("pair", ["PaSsWoRd=hunter2x", "passWORD = hunter2x", "pAsSwOrD='hunter2x'"])
def test_a_password_pair_in_mixed_case_is_masked_on_the_dead_letters_own_page(
    db: store.Store, pair: str
) -> None:
    """redaction.redact ran its password= pattern (case-insensitive) only when the text held
    "assword" or "ASSWORD": "PaSsWoRd=hunter2x" was shown in clear on the dead letter's own page
    (and in a log line), while the list, redacted by Postgres with the same pattern ('gi'), masked
    it."""
    with psycopg.connect(db.settings.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs_dead")
    console.bury(db.settings.dsn, [{"error": f"could not connect: {pair} host=db"}])
    (row,) = admin.Admin(db.conn, db.names).dead_list(admin.DeadFilter())
    assert "hunter2x" not in text.error(row["error"], text.FULL_CHARS)
    (listed,) = admin.Admin(db.conn, db.names).dead_page(admin.DeadFilter(limit=1), 200, 4096)
    assert "hunter2x" not in text.error(listed["error"])
    assert "hunter2x" not in redaction.redact(pair)  # a log line's


_SPACES = " \t\n\x0b\x0c\r\x1c\x1f\x85\xa0\u1680\u2000\u2007\u200a\u2028\u202f\u205f\u3000"


@hsettings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    error=st.text(alphabet=_SPACES + "ab:/@=\\", max_size=12).flatmap(
        lambda tail: st.sampled_from(["x://u:pa", "password=pa", "password = 'pa", "PASSWORD=pa"]).map(
            lambda head: head + tail + "@db/x"
        )
    )
)
def test_postgres_and_python_redact_an_error_alike(db: store.Store, error: str) -> None:
    """A list's error is redacted by Postgres, the dead letter's own page (and the logs) by Python,
    with the same patterns; their \\s disagreed (a no-break space, U+2007, U+202F, U+0085 and
    U+001C-U+001F are whitespace to Python only): "x://u:pa<no-break space>ss@db" was masked on
    the list and shown on the dead letter's own page. Whitespace is ASCII's in both now, and a
    quoted password's backslash escapes a newline in both ("." takes one in Postgres). (A
    closing quote followed by more text is left out: there Postgres takes the longest branch of
    the pattern, Python the first, and Postgres masks more.)"""
    params = admin.DeadFilter().params()
    (postgres,) = db.conn.execute(  # type: ignore[misc]
        "SELECT regexp_replace(regexp_replace(%(error)s, %(url_password)s, %(url_mask)s, 'g'),"
        " %(pair_password)s, %(pair_mask)s, 'gi')",
        {**params, "error": error},
    ).fetchone()
    db.conn.rollback()
    assert redaction.redact(error) == postgres


def test_a_term_may_match_the_mask_a_page_shows(db: store.Store) -> None:
    """What a page shows holds ``***`` where it masks: a term matching the mask (or spanning it)
    finds the row, as the page shows it, though the stored text lacks the term; never the
    masked piece."""
    with psycopg.connect(db.settings.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs_dead")
    console.bury(
        db.settings.dsn,
        [{"error": "no route: x://u:hunter2222@db/q", "kwargs": {"password": "hunter2222", "n": 1}}],
    )
    assert _found(db, error=":***@db") == 1 and _found(db, error="hunter2222") == 0
    assert _found(db, arg="***") == 1 and _found(db, arg="hunter") == 0
    assert _found(db, arg="n") == 1 and _found(db, arg="*") == 1


def test_an_action_over_a_text_search_takes_what_the_page_shows(db: store.Store) -> None:
    """The confirmation counts, and the action takes, the dead letters whose shown text holds
    the term: not one whose stored text holds it where the page masks it."""
    with psycopg.connect(db.settings.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs_dead")
    console.bury(
        db.settings.dsn,
        [
            {"job_name": "masked", "kwargs": {"note": "password=hunter2222 then hunter2222"}},
            {"job_name": "shown", "kwargs": {"note": "hunter2222"}},
        ],
    )
    queries = admin.Admin(db.conn, db.names)
    chosen = admin.DeadFilter(arg="hunter2222")
    count, upto = queries.dead_extent(chosen)
    db.conn.commit()
    assert count == 1
    assert queries.dead_purge(dataclasses.replace(chosen, upto=upto), 2) == admin.Acted(0, changed=1)
    assert queries.dead_purge(dataclasses.replace(chosen, upto=upto), count).done == 1
    (left,) = queries.dead_list(admin.DeadFilter())
    assert left["job_name"] == "masked"
    assert queries.dead_retry(chosen, 1) == admin.Acted(0, changed=0)


def test_pythons_work_on_a_broad_term_is_bounded(db: store.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A term many dead letters hold costs Python nothing where no masking can touch them
    (Postgres decides), and where masking can (a secret-named key in each), at most the walk's
    bound of them: the walk ends there and says where the next one starts."""
    dsn = db.settings.dsn
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs_dead")
        conn.execute(
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
            " options, created_at, attempts, error, dead_at)"
            " SELECT n, 'j', '[]', CASE WHEN n <= 300 THEN jsonb_build_object('token', 'error', 'n', n)"
            " ELSE jsonb_build_object('note', 'an error', 'n', n) END,"
            " 'default', 'default', gen_random_uuid(), '{}', now(), 3, 'boom', now()"
            " FROM generate_series(1, 2000) AS n"
        )
    checked: list[object] = []
    shown = admin._arg_shown
    monkeypatch.setattr(
        admin, "_arg_shown", lambda values, term: checked.append(values) or shown(values, term)
    )
    queries = admin.Admin(db.conn, db.names)
    walk = queries.dead_matching(admin.DeadFilter(arg="error", limit=10), 1_000, 20_000)
    assert walk == admin.Matching(1_000, list(range(2000, 1990, -1)), None) and not checked
    walk = queries.dead_matching(
        admin.DeadFilter(arg="error", upto=400, limit=10), 1_000, 20_000, check_rows=50
    )
    assert len(checked) == 50
    assert walk.matching == 100 and walk.unreached == 250 and walk.cut  # 100 settled, 50 checked
    assert queries.dead_extent(admin.DeadFilter(arg="error")) == (1700, 2000)


def test_a_walk_cut_by_pythons_bound_says_where_it_stopped(database: str, tmp_path: Path) -> None:
    """Where Python decided as many dead letters as a walk may (each holding the term only in a
    masked value), the page says how far it read, not "among the newest 20,000", and links on
    from there."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
            " options, created_at, attempts, error, dead_at)"
            " SELECT n, 'j', '[]', jsonb_build_object('token', 'needle' || n), 'default', 'default',"
            " gen_random_uuid(), '{}', now(), 3, 'boom', now() FROM generate_series(1, 1200) AS n"
        )
    with console.running(database, tmp_path) as site:
        site.sign_in()
        page = site.get("/dead?" + urllib.parse.urlencode({"arg": "needle"})).body
    assert admin.CHECK_ROWS == 1_000
    assert "among those numbered above 200" in page and "start=200" in page, page[-800:]
    assert "among the newest" not in page


def _bury_maskable(db: store.Store, rows: int) -> None:
    """``rows`` dead letters whose 3 kB arguments a page may mask (a secret-named key in each):
    in three of four the term is shown (numbers 4k: no masking can touch them, Postgres decides;
    4k+2, 4k+3: Python decides), in the others only in the masked value."""
    with psycopg.connect(db.settings.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs_dead")
        conn.execute(
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
            " options, created_at, attempts, error, dead_at)"
            " SELECT n, 'j', '[]', CASE n %% 4"
            "   WHEN 0 THEN jsonb_build_object('note', 'needle ' || n)"
            "   WHEN 1 THEN jsonb_build_object('token', 'needle', 'note', filler)"
            "   ELSE jsonb_build_object('token', 't', 'note', 'needle ' || filler) END,"
            " 'default', 'default', gen_random_uuid(), '{}', now(), 3, 'boom', now()"
            " FROM generate_series(1, %s) AS n, LATERAL (SELECT string_agg(md5(n || '.' || i), '')"
            "   AS filler FROM generate_series(1, 100) AS i) AS made",
            (rows,),
        )


def test_an_actions_walk_holds_one_page_of_candidates_at_a_time(
    db: store.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The confirmation's count and the action's dead letters under a text search came from one
    fetch of every candidate, unbounded: 100,000 dead letters with large maskable arguments and a
    broad term put all their text in the console's memory at once (500 MB, 26 s). The walk now
    fetches a page at a time (CHECK_ROWS dead letters, CHECK_BYTES of arguments) and keeps the
    matching numbers only. Here pages of 7 and 20 kB over 100 dead letters of 3 kB: the same
    count, and the action takes exactly those."""
    _bury_maskable(db, 100)
    monkeypatch.setattr(admin, "CHECK_ROWS", 7)
    monkeypatch.setattr(admin, "CHECK_BYTES", 20_000)
    fetched: list[tuple[int, int]] = []  # each fetch: rows, characters of their values
    fetchall = psycopg.Cursor.fetchall

    def counted(cursor: psycopg.Cursor[Any]) -> list[Any]:
        found = fetchall(cursor)
        fetched.append((len(found), sum(len(str(value)) for row in found for value in row)))
        return found

    monkeypatch.setattr(psycopg.Cursor, "fetchall", counted)
    queries = admin.Admin(db.conn, db.names)
    chosen = admin.DeadFilter(arg="needle")
    count, upto = queries.dead_extent(chosen)
    db.conn.commit()
    assert (count, upto) == (75, 100)
    assert len(fetched) >= 100 // 7, fetched
    assert max(rows for rows, _ in fetched) <= 7, fetched
    assert max(chars for _, chars in fetched) < 20_000 + 4_000, fetched  # the first whatever its size
    assert queries.dead_purge(dataclasses.replace(chosen, upto=upto), count).done == 75
    left = queries.dead_list(admin.DeadFilter())
    assert sorted(row["dead_id"] for row in left) == list(range(1, 100, 4))


def test_an_actions_walk_is_bounded_as_one_statement_is(
    db: store.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk as a whole gets the session's statement_timeout, as the one statement it replaced
    had: beyond it, QueryCanceled, as that statement's (the console: "The query took longer than
    N s: narrow the filter."), and nothing is touched."""
    _bury_maskable(db, 40)
    monkeypatch.setattr(admin, "CHECK_ROWS", 7)
    queries = admin.Admin(db.conn, db.names)
    queries.limit_statements(5_000)
    ticks = iter(range(1_000_000))  # a second a reading: past 5 s before the seventh page
    monkeypatch.setattr(admin, "time", types.SimpleNamespace(monotonic=lambda: float(next(ticks))))
    with pytest.raises(psycopg.errors.QueryCanceled):
        queries.dead_purge(admin.DeadFilter(arg="needle"), 30)
    db.conn.rollback()
    assert console.count(db.settings.dsn) == 40
