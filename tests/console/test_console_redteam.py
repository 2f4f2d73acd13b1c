"""Red team findings against ``drain console``: each test drives a real ``drain console`` process
on its own database and shows one broken promise (marked xfail strict until it is fixed)."""

from __future__ import annotations

import contextlib
import re
import string
import urllib.parse
import urllib.request
from pathlib import Path

import psycopg
import pytest

from tests.support import console

pytest.importorskip("uvicorn")
pytest.importorskip("drain.console.app")

SECRET = "s3cret-pass-word"


def _matching(site: console.Console, query: str) -> int:
    found = re.search(r'id="matching"><strong>([\d,]+)</strong>', site.get(f"/dead?{query}").body)
    assert found is not None
    return int(found.group(1).replace(",", ""))


def _set_kwargs(dsn: str, dead_id: int, text: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE staged_jobs_dead SET job_kwargs = %s::jsonb WHERE dead_id = %s", (text, dead_id))


def test_the_arguments_filter_is_an_oracle_for_masked_secrets(database: str, tmp_path: Path) -> None:
    """The pages mask the value of a secret-named key (kwargs password: ***), but the arguments
    filter runs ``strpos(job_kwargs::text, arg)`` over the unmasked text: a read-only visitor asks
    ``"password": "a``, ``"password": "b``, ... and the count (1 or 0) spells the password out.
    Expected: the filter cannot see a masked value (or the page refuses a filter on it)."""
    secret = "k7q2zx"
    console.bury(database, [{"job_name": "mail.send", "kwargs": {"password": secret, "to": "x@example.com"}}])
    alphabet = string.ascii_lowercase + string.digits
    with console.running(database, tmp_path, token=None) as site:
        assert secret not in site.get("/dead/1").body  # masked where it is shown...
        recovered = ""
        for _ in range(len(secret)):
            for char in alphabet:
                guess = recovered + char
                query = urllib.parse.urlencode({"arg": f'"password": "{guess}'})
                if _matching(site, query) == 1:
                    recovered = guess
                    break
            else:
                break
    assert recovered != secret, f"read back the masked password {recovered!r} through the filter"


@pytest.mark.parametrize(
    "filler",
    [
        pytest.param("[" * 1500 + "]" * 1500, id="deep-json"),
        pytest.param("1" * 5000, id="long-number"),
    ],
)
def test_undecodable_arguments_show_their_secrets_in_clear(
    database: str, tmp_path: Path, filler: str
) -> None:
    """admin._AsText hands back a value Python cannot load (RecursionError, the int
    digit limit's ValueError) as its text; text.pretty / text.brief then only ``redact`` it (URL
    passwords, ``password=`` pairs), and ``"password": "..."`` is neither: the dead letter's own
    page (and, for the small deep one, the list page) shows the password in clear.
    Expected: *** as for any other dead letter (e.g. mask the whole value when it is text)."""
    (dead_id,) = console.bury(database, [{"job_name": "mail.send"}])
    _set_kwargs(database, dead_id, f'{{"password": "{SECRET}", "api_token": "{SECRET}", "filler": {filler}}}')
    with console.running(database, tmp_path, token=None) as site:
        pages = {path: site.get(path).body for path in ("/dead", f"/dead/{dead_id}")}
    leaked = [path for path, body in pages.items() if SECRET in body]
    assert not leaked, f"the password shows in clear on {leaked}"


def test_common_spellings_of_secret_keys_are_masked(database: str, tmp_path: Path) -> None:
    """redaction._SECRET_NAME matches ``api_key`` but not ``apiKey``, ``apikey``, ``api-key``,
    ``X-Api-Key`` or ``Cookie`` (as HTTP client jobs carry them in their kwargs/options):
    the dead letter's page shows them. Expected: masked like ``api_key``."""
    (dead_id,) = console.bury(
        database,
        [
            {
                "job_name": "webhook.post",
                "kwargs": {
                    "apiKey": SECRET + "1",
                    "headers": {"X-Api-Key": SECRET + "2", "Cookie": SECRET + "3"},
                },
                "options": {"apikey": SECRET + "4", "api-key": SECRET + "5"},
            }
        ],
    )
    with console.running(database, tmp_path, token=None) as site:
        body = site.get(f"/dead/{dead_id}").body
    shown = sorted(set(re.findall(re.escape(SECRET) + r"\d", body)))
    assert not shown, f"secrets shown in clear: {shown}"


def test_an_action_touches_no_more_than_its_confirmation_counted(database: str, tmp_path: Path) -> None:
    """The confirmation says "Purge 1 dead letter(s)?" and posts ``confirmed=1``; the act re-runs
    the filter and the ``confirmed`` field only goes to the log. A dead letter the leader buries
    meanwhile (same job name) is purged too, never shown to the operator: the log line even says
    "purge 2 dead letter(s) (1 confirmed". Expected: the act touches at most the confirmed dead
    letters (e.g. those with dead_id <= the highest counted), or refuses when the count changed."""
    console.bury(database, [{"job_name": "mail.send", "kwargs": {"n": 1}}])
    with console.running(database, tmp_path) as site:
        site.sign_in()
        confirm = site.post(
            "/dead/confirm", {"csrf": site.csrf(), "action": "purge", "job_name": "mail.send"}
        )
        assert confirm.status == 200 and "Purge 1 dead letter(s)?" in confirm.body
        form = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirm.body)
        assert ("confirmed", "1") in form
        console.bury(database, [{"job_name": "mail.send", "kwargs": {"n": 2}}])  # the leader, meanwhile
        done = site.post("/dead/act", form)
        assert done.status == 200
    assert console.count(database) == 1, f"{done.body[done.body.find('notice') :][:80]!r}"


def test_cookie_less_visitors_cannot_sign_the_operator_out(database: str, tmp_path: Path) -> None:
    """Each request without the cookie starts a session (access.Access.session); beyond
    MAX_SESSIONS (1,000) the oldest is dropped, signed in or not, and a session is never moved up
    when used. So a flood of anonymous GETs (no credential, no CSRF token needed; from a
    cross-site page, ``<img src=http://127.0.0.1:PORT/login>`` x 1,000 does it, as no cookie goes
    with them) signs the operator out, mid-confirmation too (the act then fails: CSRF).
    Expected: anonymous sessions cannot evict a signed-in one (separate bounds, or no session
    stored before it is needed)."""
    console.bury(database, [{"job_name": "a"}])
    with console.running(database, tmp_path) as site:
        site.sign_in()
        assert "admin: ops" in site.get("/dead").body
        opener = urllib.request.build_opener()  # no cookie jar: as a cross-site request
        for _ in range(1_001):
            with opener.open(site.url + "/login", timeout=30) as reply:
                reply.read()
        page = site.get("/dead").body
    assert "admin: ops" in page, "the operator was signed out by anonymous requests"


def test_concurrent_visitors_hold_a_bounded_number_of_database_sessions(
    database: str, tmp_path: Path
) -> None:
    """figures.Sessions keeps at most IDLE_SESSIONS idle, but opens a new one for each request
    that finds none idle: 30 anonymous requests to a page whose statements wait (a slow text
    filter; here a lock an app holds, the cheap way to make them wait) hold 30 backends for up to
    PAGE_TIMEOUT_MS each. The threadpool (40) is the only bound; the server's max_connections is
    shared with the drain's leader and standbys, which may then fail to reconnect.
    Expected: a small cap on the console's own sessions (a request beyond it waits or is refused)."""
    import threading

    console.bury(database, [{"job_name": "a"}])
    with console.running(database, tmp_path, token=None) as site:
        site.get("/dead")
        with psycopg.connect(database) as holder:
            holder.execute("LOCK TABLE staged_jobs_dead IN ACCESS EXCLUSIVE MODE")

            def visit() -> None:
                with urllib.request.urlopen(site.url + "/dead?arg=x", timeout=30) as reply:
                    reply.read()

            visitors = [threading.Thread(target=lambda: _quietly(visit)) for _ in range(30)]
            for visitor in visitors:
                visitor.start()
            peak = 0
            with psycopg.connect(database, autocommit=True) as watcher:
                for _ in range(30):
                    row = watcher.execute(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE application_name LIKE 'drain-console/%%' AND datname = current_database()"
                    ).fetchone()
                    assert row is not None
                    peak = max(peak, int(row[0]))
                    if peak >= 30:
                        break
                    import time

                    time.sleep(0.1)
            holder.rollback()
        for visitor in visitors:
            visitor.join(30)
    assert peak <= 8, f"{peak} database sessions held by anonymous visitors at once"


def _quietly(work: object) -> None:
    with contextlib.suppress(Exception):
        work()  # type: ignore[operator]


def test_the_error_filter_is_an_oracle_for_redacted_passwords(database: str, tmp_path: Path) -> None:
    """text.error shows ``password=***``, but the error filter is ``strpos(lower(error), ...)`` on
    the stored text: ``password=h`` matches, ``password=x`` does not. Expected: no filter sees
    what the page hides."""
    console.bury(
        database, [{"job_name": "db.sync", "error": f"could not connect: password={SECRET} host=db"}]
    )
    with console.running(database, tmp_path, token=None) as site:
        assert SECRET not in site.get("/dead").body
        right = _matching(site, urllib.parse.urlencode({"error": f"password={SECRET[:6]}"}))
        wrong = _matching(site, urllib.parse.urlencode({"error": "password=zzzzzz"}))
    assert right == wrong, "the error filter tells the redacted password's letters apart"


def test_deeply_nested_arguments_do_not_break_the_pages(database: str, tmp_path: Path) -> None:
    """The promise: hostile rows render as inert, bounded text. JSON nested 1,500 deep comes as text
    (RecursionError in the loader), but 800 deep loads, and redaction.masked / json.dumps recurse
    once per level on top of the request's own stack: RecursionError, an Internal Server Error
    for the whole unfiltered list. Expected: the list and the dead letter's page render (e.g. the
    value shown as its cut text)."""
    (hostile, plain) = console.bury(database, [{"job_name": "deep"}, {"job_name": "plain"}])
    _set_kwargs(database, hostile, '{"x": ' + "[" * 800 + "]" * 800 + "}")
    with console.running(database, tmp_path, token=None) as site:
        statuses = {path: site.get(path).status for path in ("/dead", f"/dead/{hostile}", f"/dead/{plain}")}
    assert statuses == {"/dead": 200, f"/dead/{hostile}": 200, f"/dead/{plain}": 200}, statuses


def test_a_hook_that_returns_an_empty_name_may_not_act(database: str) -> None:
    """A careless hook such as ``lambda request: request.headers.get("x-user", "")`` returns "" for
    an anonymous request: every page says read-only and shows no button (``{% if operator %}``),
    but _acting_form only refuses ``operator is None``, so a hand-made POST (with the session's
    CSRF token, read from any page) purges. Expected: a falsy name is read-only everywhere."""
    import threading

    import uvicorn

    from drain import config
    from drain.console import app
    from tests.support import faultload
    from tests.support.waiting import wait_until

    def authorize(request: object) -> str | None:
        return request.headers.get("x-user", "")  # type: ignore[attr-defined,no-any-return]

    console.bury(database, [{"job_name": "a"}])
    port = faultload.free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app.build(config.Settings(dsn=database), authorize=authorize), port=port, log_config=None
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until("the console to listen", lambda: server.started, 30)
        site = console.Console(f"http://127.0.0.1:{port}", None)
        page = site.get("/dead").body
        assert 'id="read-only"' in page and 'id="purge-all"' not in page
        done = site.post("/dead/act", {"csrf": site.csrf(), "action": "purge"})
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert done.status == 403 and console.count(database) == 1, done.status


def test_the_log_says_where_a_request_came_from_not_what_it_claims(database: str, tmp_path: Path) -> None:
    """serving.serve leaves uvicorn's proxy_headers on, with forwarded_allow_ips 127.0.0.1: every
    request through an SSH tunnel or from this host comes from 127.0.0.1, so its X-Forwarded-For
    replaces request.client. A token guesser's failed sign-ins are then logged "from 203.0.113.9"
    (someone else), an action as from any address. Expected: the peer's own address (or the
    forwarded one only when a proxy was configured)."""
    with console.running(database, tmp_path) as site:
        csrf = site.csrf("/login")
        reply = site.post_as(
            "/login", {"csrf": csrf, "token": "x" * 30, "name": "x"}, {"X-Forwarded-For": "203.0.113.9"}
        )
        assert reply.status == 403
        assert site.process is not None
        log = site.process.output()
    assert "a sign-in from 203.0.113.9 failed" not in log, "the log names the address the request claimed"


def test_a_retry_that_moves_nothing_says_why(database: str, tmp_path: Path) -> None:
    """admin.dead_retry leaves a dead letter whose job_id is staged again already where it is, and
    counts it in neither refused nor taken; the notice then reads "0 dead letter(s) staged again."
    (the log: "retry 0 dead letter(s) (1 confirmed, 0 refused by the table, 0 taken"), and the
    dead letter is still listed. Expected: the notice says 1 left and why."""
    (dead_id,) = console.bury(database, [{"job_name": "mail.send"}])
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (job_name, job_id, run_at)"
            " SELECT job_name, job_id, now() + interval '1 hour' FROM staged_jobs_dead WHERE dead_id = %s",
            (dead_id,),
        )
    with console.running(database, tmp_path) as site:
        site.sign_in()
        done = site.post(
            "/dead/act",
            {"csrf": site.csrf(), "action": "retry:selected", "id": str(dead_id), "confirmed": "1"},
        )
    assert console.count(database) == 1
    notice = re.search(r'id="notice">([^<]*)<', done.body)
    assert notice is not None
    assert notice.group(1) != "0 dead letter(s) staged again.", notice.group(1)


def test_an_action_cut_by_its_timeout_names_its_own_bound(database: str, tmp_path: Path) -> None:
    """app._failure always quotes figures.PAGE_TIMEOUT_MS, but an action runs under
    settings.statement_timeout_s (figures.Sessions(acting=True)): with statement_timeout_s = 0.1
    a retry filtered on the arguments over 100,000 dead letters is cancelled after 0.1 s and the
    page says "The query took longer than 5 s". Expected: the bound that applied (0.1 s)."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
            " options, created_at, attempts, error, dead_at)"
            " SELECT 9000000 + g, 'j', jsonb_build_array(repeat(md5(g::text), 8)), '{}', 'default',"
            " 'default', gen_random_uuid(), '{}', now(), 1, 'e', now() FROM generate_series(1, 100000) g"
        )
    settings_file = tmp_path / "drain.toml"
    settings_file.write_text(f'dsn = "{database}"\nstatement_timeout_s = 0.1\n', encoding="utf-8")
    with console.running(database, tmp_path, args=["--config", str(settings_file)]) as site:
        site.sign_in()
        done = site.post("/dead/act", {"csrf": site.csrf(), "action": "retry", "arg": "no-such-value"})
    assert done.status == 503 and "longer than" in done.body, done.body[-600:]
    assert "longer than 5 s" not in done.body


@pytest.mark.parametrize("invisible", ["\u3164", "\u034f", "\ufe0f", "\u2800", "\u115f"])
def test_invisible_letters_are_shown_as_their_escapes(database: str, tmp_path: Path, invisible: str) -> None:
    """text.inert escapes a character by its Unicode category; these are letters, marks or
    symbols (Lo, Mn, So) yet render as nothing (or as a blank), so ``mail.send`` + U+3164 reads as
    ``mail.send`` on the page while the job-name filter (an exact match) tells them apart. The
    docs: "control characters, bidi overrides and other invisible characters are shown as their
    escapes ... so what is shown is what is stored". Expected: the escape (``\\u3164``)."""
    (dead_id,) = console.bury(database, [{"job_name": f"mail.send{invisible}"}])
    with console.running(database, tmp_path, token=None) as site:
        body = site.get(f"/dead/{dead_id}").body
    shown = re.search(r'id="job-name">([^<]*)<', body)
    assert shown is not None
    assert shown.group(1) == f"mail.send\\u{ord(invisible):04x}", repr(shown.group(1))


def test_an_error_cut_inside_a_url_password_shows_none_of_it(database: str, tmp_path: Path) -> None:
    """dead_page reads ``left(error, 200)`` and text.error redacts what is left; the URL pattern
    needs ``user:password@``, and the cut took the ``@``: ``redis://:s3cret-pas`` is shown on
    /dead. (The dead letter's own page reads the whole error and redacts it.) Expected: no piece
    of the password (redact before cutting, or drop a trailing ``scheme://user:...``)."""
    error = "x" * 180 + f" redis://:{SECRET}@cache:6379/0 Connection refused"
    console.bury(database, [{"job_name": "cache.warm", "error": error}])
    with console.running(database, tmp_path, token=None) as site:
        body = site.get("/dead").body
    assert SECRET[:8] not in body, "a prefix of the URL's password is on the list page"


def test_a_rotated_token_file_ends_the_old_token_and_its_sessions(database: str, tmp_path: Path) -> None:
    """access.token_from reads the file when the console starts; the docs say nothing of rotating
    it. After the file holds a new token, the old one still signs in and a session opened with it
    still purges. Expected: the file's current token only (re-read, or a restart the docs demand,
    with the console refusing the old one)."""
    console.bury(database, [{"job_name": "a"}, {"job_name": "b"}])
    token_file = tmp_path / "token"
    token_file.write_text(console.TOKEN, encoding="utf-8")
    with console.running(database, tmp_path, token=None, args=["--token-file", str(token_file)]) as site:
        assert site.sign_in().status == 200
        token_file.write_text("a-brand-new-token-after-the-leak-0123", encoding="utf-8")
        stale = site.post("/dead/act", {"csrf": site.csrf(), "action": "purge", "job_name": "a"})
        other = console.Console(site.url, None)
        again = other.sign_in(console.TOKEN)
    assert (stale.status, again.status) == (403, 403), (stale.status, again.status)
