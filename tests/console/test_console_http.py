"""``drain console`` over HTTP, as a process on a real database: the headers on every page, who may
act (the admin token, CSRF, the database's own say), the filters, and what a page never shows."""

from __future__ import annotations

import html
import re
import threading
import urllib.parse
from pathlib import Path

import psycopg
import pytest

from drain import config
from tests.support import console, faultload, processes, roles
from tests.support.waiting import wait_until

uvicorn = pytest.importorskip("uvicorn")
app = pytest.importorskip("drain.console.app")

SECRET = "s3cret-pass-word"


def test_every_page_has_the_security_headers_and_no_dsn(database: str, tmp_path: Path) -> None:
    console.bury(database, [{"job_name": "tasks.send"}])
    with console.running(database, tmp_path) as site:
        for path in ("/", "/dead", "/dead/1", "/login", "/no-such-page"):
            reply = site.get(path)
            csp = reply.headers["content-security-policy"]
            assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp, path
            assert "script-src" not in csp  # none at all: default-src 'none'
            assert reply.headers["x-frame-options"] == "DENY"
            assert reply.headers["cache-control"] == "no-store"
            assert reply.headers["x-content-type-options"] == "nosniff"
            assert database not in reply.body and "postgresql://" not in reply.body
        cookie = next(iter(site.cookies))
        assert cookie.name == "drain_console" and cookie.has_nonstandard_attr("HttpOnly")
        fresh = console.Console(site.url, None)
        assert "samesite=strict" in fresh.get("/").headers["set-cookie"].lower()


def test_without_a_token_it_is_read_only_and_refuses_actions(database: str, tmp_path: Path) -> None:
    console.bury(database, [{"job_name": "a"}, {"job_name": "b"}])
    with console.running(database, tmp_path, token=None) as site:
        page = site.get("/dead").body
        assert "read-only" in page and 'id="retry-all"' not in page
        csrf = site.csrf()
        for path in ("/dead/confirm", "/dead/act"):
            reply = site.post(path, {"csrf": csrf, "action": "purge", "confirmed": "2"})
            assert reply.status == 403, reply.body
        assert site.get("/login").status == 404
    assert console.count(database) == 2


def test_a_wrong_token_signs_nobody_in_and_the_token_shows_nowhere(database: str, tmp_path: Path) -> None:
    console.bury(database, [{"job_name": "a"}])
    with console.running(database, tmp_path) as site:
        wrong = site.sign_in("x" * 30)
        assert wrong.status == 403
        assert site.post("/dead/act", {"csrf": site.csrf(), "action": "purge"}).status == 403
        signed = site.sign_in()
        assert signed.status == 200 and "admin: ops" in signed.body
        for path in ("/", "/dead", "/dead/1", "/login"):
            assert console.TOKEN not in site.get(path).body
        assert all(console.TOKEN not in cookie.value for cookie in site.cookies if cookie.value)
        log = site.process.output()
    assert console.TOKEN not in log and "x" * 30 not in log
    assert "ops signed in" in log


def test_an_action_needs_this_sessions_csrf_token(database: str, tmp_path: Path) -> None:
    console.bury(database, [{"job_name": "a"}])
    with console.running(database, tmp_path) as site:
        site.sign_in()
        for csrf in ("", "forged", site.csrf() + "x"):
            reply = site.post("/dead/act", {"csrf": csrf, "action": "purge", "confirmed": "1"})
            assert reply.status == 403, csrf
        assert console.count(database) == 1
        done = site.post("/dead/act", {"csrf": site.csrf(), "action": "purge", "confirmed": "1"})
        assert done.status == 200 and "1 dead letter(s) purged" in done.body
        assert console.count(database) == 0
        log = site.process.output()
    assert re.search(r"console: ops from 127\.0\.0\.1: purge 1 dead letter\(s\) \(1 confirmed", log), log


def test_a_page_read_through_another_host_name_is_refused(database: str, tmp_path: Path) -> None:
    with console.running(database, tmp_path) as site:
        assert site.get("/", {"Host": "attacker.example"}).status == 400
        assert site.get("/", {"Host": "localhost"}).status == 200


def test_a_role_that_may_not_write_makes_it_read_only_by_itself(database: str, tmp_path: Path) -> None:
    """The drain's role without INSERT on the table (no [[schedules]]) cannot retry: the console
    says so and refuses, signed in or not."""
    console.bury(database, [{"job_name": "a"}])
    with roles.drain_role(database) as dsn, console.running(dsn, tmp_path) as site:
        site.sign_in()
        page = site.get("/dead").body
        assert 'id="cannot-act"' in page and 'id="retry-all"' not in page
        reply = site.post("/dead/confirm", {"csrf": site.csrf(), "action": "retry"})
        assert reply.status == 409 and "may not insert" in reply.body
    assert console.count(database) == 1


def test_filters_select_what_an_action_touches(database: str, tmp_path: Path) -> None:
    console.bury(
        database,
        [
            {"job_name": "mail.send", "kwargs": {"user_id": 42}, "error": "SMTP Timeout"},
            {"job_name": "mail.send", "kwargs": {"user_id": 7}, "error": "smtp timeout"},
            {"job_name": "mail.send", "kwargs": {"user_id": 42}, "error": "refused", "queue": "slow"},
            {"job_name": "bill.charge", "args": [42], "error": "timeout", "ordering_key": "acct-1"},
            {"job_name": "old", "dead_at": "2001-01-01T00:00:00Z"},
        ],
    )
    with console.running(database, tmp_path) as site:

        def matching(query: str) -> int:
            found = re.search(r'id="matching"><strong>([\d,]+)</strong>', site.get(f"/dead?{query}").body)
            assert found is not None
            return int(found.group(1).replace(",", ""))

        assert matching("") == 5
        assert matching("job_name=mail.send") == 3
        assert matching("error=TIMEOUT") == 3  # any case, a substring
        assert matching("arg=42") == 3  # keyword or positional, in the JSON text
        assert matching("job_name=mail.send&arg=42&queue=default") == 1
        assert matching("ordering_key=acct-1") == 1
        assert matching("until=2002-01-01T00:00") == 1
        assert matching("since=2002-01-01T00:00") == 4
        assert matching("error=%25") == 0  # no LIKE pattern: % is itself
        assert site.get("/dead?since=yesterday").status == 400
        assert site.get("/dead?arg=" + "x" * 1001).status == 400
        site.sign_in()
        fields = {"csrf": site.csrf(), "job_name": "mail.send", "error": "timeout"}
        confirm = site.post("/dead/confirm", {**fields, "action": "retry"})
        assert "Retry 2 dead letter(s)?" in html.unescape(confirm.body)
        done = site.post("/dead/act", {**fields, "action": "retry", "confirmed": "2"})
        assert "2 dead letter(s) staged again" in done.body
    assert console.count(database) == 3
    assert console.count(database, "staged_jobs") == 2


def test_hostile_rows_are_inert_bounded_text(database: str, tmp_path: Path) -> None:
    script = "<script>document.title='pwned'</script>"
    handler = '<img src=x onerror="alert(1)">'
    huge = "A" * 2_000_000
    console.bury(
        database,
        [
            {
                "job_name": script,
                "queue": handler,
                "error": f"\u202eevil\u202c password={SECRET} postgresql://u:{SECRET}@db/x",
                "kwargs": {"password": SECRET, "blob": huge, "html": handler},
                "ordering_key": "k\x1b[31m",
            },
            {"job_name": handler, "kwargs": {"api_token": SECRET, "to": script}},
        ],
    )
    with console.running(database, tmp_path) as site:
        pages = {path: site.get(path) for path in ("/dead", "/dead/1", "/dead/2")}
    for path, reply in pages.items():
        body = reply.body
        assert reply.status == 200, path
        assert "<script>" not in body and "<img src=x" not in body, path
        assert "&lt;script&gt;" in body or "&lt;img src=x" in body, path
        assert "\u202e" not in body and "\x1b" not in body, path
        assert SECRET not in body, path
        assert len(body) < 200_000, (path, len(body))
    assert "\\u202e" in pages["/dead/1"].body and "\\x1b" in pages["/dead/1"].body
    assert "more characters)" in pages["/dead/1"].body  # the 2 MB value, cut
    assert "large: " in pages["/dead"].body  # its row in the list: its size only


def test_a_database_that_cannot_be_reached_is_said_without_its_dsn(tmp_path: Path) -> None:
    dsn = f"postgresql://someone:{SECRET}@127.0.0.1:1/nowhere"
    with console.running(dsn, tmp_path) as site:
        reply = site.get("/")
        assert reply.status == 503 and "cannot be reached" in reply.body
        assert "127.0.0.1:1" not in reply.body and SECRET not in reply.body
        log = site.process.output()
    assert SECRET not in log


def test_a_standby_is_read_only(database: str, tmp_path: Path) -> None:
    """default_transaction_read_only (as on a hot standby) makes the console refuse to act."""
    console.bury(database, [{"job_name": "a"}])
    with psycopg.connect(database, autocommit=True) as conn:
        name = conn.execute("SELECT current_database()").fetchone()
        assert name is not None
        conn.execute(f'ALTER DATABASE "{name[0]}" SET default_transaction_read_only = on')
    with console.running(database, tmp_path) as site:
        site.sign_in()
        assert "the session is read-only" in site.get("/dead").body
        assert site.post("/dead/act", {"csrf": site.csrf(), "action": "purge"}).status == 409
    assert console.count(database) == 1


def test_an_app_that_mounts_it_decides_who_acts_with_a_hook(database: str) -> None:
    """``app.build(settings, authorize=...)``: the app's own authentication says who may act."""

    def authorize(request: object) -> str | None:
        return "app-user" if request.headers.get("x-user") == "admin" else None  # type: ignore[attr-defined]

    console.bury(database, [{"job_name": "a"}, {"job_name": "b"}])
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
        site = console.Console(f"http://127.0.0.1:{port}", None)  # type: ignore[arg-type]
        assert "admin: app-user" in site.get("/dead", {"X-User": "admin"}).body
        assert "read-only" in site.get("/dead").body
        csrf = site.csrf()
        assert site.post("/dead/act", {"csrf": csrf, "action": "purge", "job_name": "a"}).status == 403
        done = site.post_as(
            "/dead/act", {"csrf": csrf, "action": "purge", "job_name": "a"}, {"X-User": "admin"}
        )
        assert done.status == 200 and "1 dead letter(s) purged" in done.body
        assert site.get("/login").status == 404  # no token to sign in with
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert console.count(database) == 1


def test_a_table_that_is_not_there_says_so(database: str, tmp_path: Path) -> None:
    with console.running(database, tmp_path, args=["--table", "elsewhere"]) as site:
        for path in ("/", "/dead"):
            reply = site.get(path)
            assert reply.status == 503
            assert (
                "table &#34;public&#34;.&#34;elsewhere&#34; does not exist; run `drain migrate`" in reply.body
            )


def test_without_the_extra_the_command_says_what_to_install(tmp_path: Path) -> None:
    """`drain console` where starlette cannot be imported: one line, exit 2; `drain` itself works."""
    blocker = tmp_path / "starlette"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {"PYTHONPATH": f"{tmp_path}:{processes.ROOT}"}
    done = processes.drain_cli("console", dsn="postgresql://nowhere/x", env=env)
    assert done.returncode == 2
    assert done.stderr.strip() == "drain: `drain console` needs its extra: pip install 'jobdrain[console]'"
    assert processes.drain_cli("--version", dsn="", env=env).returncode == 0


def test_a_page_counts_to_its_cap_and_a_text_filter_reads_the_newest_first(
    database: str, tmp_path: Path
) -> None:
    """A page counts its matches up to 1,000 (newest first: a filter many match stops there), and
    a text filter reads the newest 20,000 dead letters a page, linking to the older ones. Its
    cheap test of the stored JSON text finds a term JSON escapes (a quote) and never what is
    masked: the same dead letters as the walk of what the page shows."""
    needle = {"note": 'in "quotes" and \\ back', "api_key": "needle-secret"}
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
            " options, created_at, attempts, error, dead_at)"
            " SELECT g, 'bulk', '[]', CASE WHEN g = 5 THEN %s::jsonb ELSE jsonb_build_object('n', g) END,"
            " 'default', 'default', gen_random_uuid(), '{}', now(), 3, 'boom', now()"
            " FROM generate_series(1, 20500) AS g",
            (psycopg.types.json.Jsonb(needle),),
        )
    with console.running(database, tmp_path) as site:
        everything = html.unescape(site.get("/dead").body)
        assert 'id="matching"><strong>≥ 1,000</strong>' in everything and "counted up to 1,000" in everything
        first = html.unescape(site.get("/dead?arg=quotes").body)
        assert 'id="matching"><strong>0</strong>' in first and "among the newest 20,000" in first
        onward = re.search(r'<a href="/dead\?([^"]+)" id="onward">', first)
        assert onward is not None and "start=500" in onward.group(1)
        older = html.unescape(site.get("/dead?" + html.unescape(onward.group(1))).body)
        assert 'id="matching"><strong>1</strong>' in older and 'id="onward"' not in older

        def matching(query: str) -> int:
            found = re.search(r'id="matching"><strong>([\d,]+)</strong>', site.get(f"/dead?{query}").body)
            assert found is not None
            return int(found.group(1).replace(",", ""))

        assert matching("start=500&arg=" + urllib.parse.quote('in "quotes" and \\ b')) == 1
        assert matching("start=500&arg=needle-secret") == 0  # masked: never searched
        assert matching("start=500&arg=api_key") == 1  # a key is shown, so searched
        assert matching("start=500&error=BOOM") == 500
        assert site.get("/dead?start=x").status == 400


def test_a_term_with_the_mask_is_searched_in_what_the_page_shows(database: str, tmp_path: Path) -> None:
    """The text filters pass over a row whose stored text lacks the term, unless the term holds a
    ``*``: the mask is in what the page shows, never in the stored text."""
    console.bury(
        database,
        [
            {
                "error": "OperationalError: postgresql://app:hunter2@db/main",
                "kwargs": {"dsn": "amqp://u:pw@mq/"},
            },
            {"error": "boom", "kwargs": {"note": "a * star"}},
        ],
    )
    with console.running(database, tmp_path) as site:

        def matching(query: str) -> int:
            found = re.search(r'id="matching"><strong>([\d,]+)</strong>', site.get(f"/dead?{query}").body)
            assert found is not None
            return int(found.group(1).replace(",", ""))

        assert matching(urllib.parse.urlencode({"error": "app:***@db"})) == 1
        assert matching(urllib.parse.urlencode({"error": "hunter2"})) == 0
        assert matching(urllib.parse.urlencode({"arg": "u:***@mq"})) == 1
        assert matching(urllib.parse.urlencode({"arg": "pw@"})) == 0
        assert matching(urllib.parse.urlencode({"arg": "a * star"})) == 1
