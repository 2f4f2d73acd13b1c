"""The console's web application: its routes, its pages' headers, its refusals.

Pages
- ``GET /``: the overview (refreshes itself every REFRESH_S with a meta refresh: no script).
- ``GET /dead``: dead letters under a filter (the query string); ``GET /dead/{id}``: one, whole.
- ``POST /dead/confirm``: how many an action would touch; ``POST /dead/act``: do it, on none
  beyond the highest dead letter the confirmation counted (``upto``: one buried meanwhile waits
  for a confirmation of its own), and on none at all unless, in the act's own statement, the
  set it counted matches (``confirmed`` and ``digest``, admin.Counted: a dead letter numbered
  below ``upto`` may commit after the count, another command may take one meanwhile).
- ``GET|POST /login``, ``POST /logout``: the admin token (access.py).

Every response carries a strict Content-Security-Policy (no script at all, styles from this
origin only, no framing, forms posting here only), ``no-store``, ``nosniff``, and a referrer
for this origin only.
A page never shows the DSN: a database that cannot be reached is said to be so, the reason goes
to the console's log (redacted as every log line is).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from importlib import resources
from typing import Any, TypeVar

import jinja2
import psycopg
from starlette import applications, concurrency, requests, responses, routing
from starlette.middleware import Middleware, trustedhost
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from drain import config, errors
from drain.console import access, figures, forms, text
from drain.store import admin
from drain.store import session as store

log = logging.getLogger(__name__)
T = TypeVar("T")

REFRESH_S = 10
HEADERS = {
    "content-security-policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",  # no-referrer would make a form's Origin "null"
    "cache-control": "no-store",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def build(
    settings: config.Settings,
    *,
    token: str | None = None,
    token_file: str | None = None,
    authorize: access.Authorize | None = None,
    allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
) -> ASGIApp:
    """The console for ``settings``'s table, as an ASGI application.

    - ``token``: the admin token operators sign in with (``token_file``: the file it was read
      from, read again when it changes); ``authorize``: an app's hook instead
      (access.py); neither: read-only.
    - ``allowed_hosts``: the Host headers it answers (a page read through another name, as DNS
      rebinding would, is refused); ``["*"]`` answers any.
    """
    console = _Console(settings, access.Access(token=token, authorize=authorize, token_file=token_file))
    page = console.route
    routes = [
        routing.Route("/", page(console.overview)),
        routing.Route("/dead", page(console.dead)),
        routing.Route("/dead/{dead_id:int}", page(console.dead_letter)),
        routing.Route("/dead/confirm", page(console.confirm), methods=["POST"]),
        routing.Route("/dead/act", page(console.act), methods=["POST"]),
        routing.Route("/login", page(console.login), methods=["GET", "POST"]),
        routing.Route("/logout", page(console.logout), methods=["POST"]),
        routing.Route("/console.css", _stylesheet),
    ]
    app = applications.Starlette(
        routes=routes,
        middleware=[Middleware(trustedhost.TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))],
    )
    return _SecurityHeaders(app)


class _SecurityHeaders:
    """Adds HEADERS to every response, the framework's own (404, 405, 400) too."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k.decode().lower() not in HEADERS]
                added = [(name.encode(), value.encode()) for name, value in HEADERS.items()]
                message = {**message, "headers": kept + added}
            await send(message)

        await self._app(scope, receive, sending)


@functools.cache
def _templates() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("drain.console", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    environment.filters.update(
        field=text.field,
        pretty=text.pretty,
        brief=text.brief,
        error=text.error,
        when=figures.when,
        number="{:,}".format,
    )
    return environment


async def _stylesheet(request: requests.Request) -> responses.Response:
    css = resources.files("drain.console").joinpath("static/console.css").read_text(encoding="utf-8")
    return responses.Response(css, media_type="text/css")


@dataclasses.dataclass
class _Visit:
    """One request's session: its id (the cookie), its state, who it acts as (None: read-only)."""

    session_id: str
    session: access.Session
    operator: str | None
    new: bool


Handler = Callable[[requests.Request, _Visit], Awaitable[responses.Response]]


def _set_cookie(response: responses.Response, request: requests.Request, session_id: str) -> None:
    response.set_cookie(
        access.COOKIE,
        session_id,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )


def _client(request: requests.Request) -> str:
    return request.client.host if request.client else "?"


class _Console:
    """The pages of one console (one table, one credential)."""

    def __init__(self, settings: config.Settings, console_access: access.Access) -> None:
        self.sessions = figures.Sessions(settings)
        self.access = console_access

    def route(self, handler: Handler) -> Callable[[requests.Request], Awaitable[responses.Response]]:
        """``handler`` as a route: the session found or started (its cookie set), a refusal or a
        database failure rendered as a page of its own."""

        async def endpoint(request: requests.Request) -> responses.Response:
            given = request.cookies.get(access.COOKIE)
            session_id, session = self.access.session(given)
            operator = self.access.operator(request, session) or None  # "": read-only too
            visit = _Visit(session_id, session, operator, session_id != given)
            try:
                response = await handler(request, visit)
            except forms.Refused as refused:
                response = self.render(visit, "message.html", {"message": refused.message}, refused.status)
            except (errors.DrainError, psycopg.Error) as exc:
                response = self.render(visit, "message.html", {"message": _failure(exc)}, 503)
            if visit.new:
                _set_cookie(response, request, visit.session_id)
            return response

        return endpoint

    def render(
        self, visit: _Visit, template: str, context: Mapping[str, Any], status: int = 200
    ) -> responses.HTMLResponse:
        notice, visit.session.notice = visit.session.notice, None
        page = (
            _templates()
            .get_template(template)
            .render(
                operator=visit.operator,
                csrf=visit.session.csrf,
                signs_in=self.access.signs_in,
                read_only=self.access.read_only,
                notice=notice,
                **context,
            )
        )
        return responses.HTMLResponse(page, status_code=status)

    async def _run(self, work: Callable[[store.Store], T], *, acting: bool = False) -> T:
        """``work`` on a session of its own, in a worker thread (psycopg's calls block)."""

        def on_a_session() -> T:
            try:
                with self.sessions.session(acting=acting) as db:
                    return work(db)
            except figures.Busy:
                raise forms.Refused(
                    503, "The console is busy (every database session it may open is in use): try again."
                ) from None
            except psycopg.errors.QueryCanceled:
                bound_s = self.sessions.timeout_ms(acting=acting) / 1000
                raise forms.Refused(
                    503, f"The query took longer than {bound_s:g} s: narrow the filter."
                ) from None

        return await concurrency.run_in_threadpool(on_a_session)

    # --- pages ------------------------------------------------------------------------------

    async def overview(self, request: requests.Request, visit: _Visit) -> responses.Response:
        found, able = await self._run(lambda db: (figures.overview(db), figures.abilities(db)))
        return self.render(visit, "overview.html", {"o": found, "able": able, "refresh_s": REFRESH_S})

    async def dead(self, request: requests.Request, visit: _Visit) -> responses.Response:
        fields, chosen = forms.filters(request.query_params)
        (page, walk), able = await self._run(
            lambda db: (figures.dead_page(db, chosen, text.FIELD_CHARS), figures.abilities(db))
        )
        onward = None if walk.unreached is None else forms.query({**fields, "start": str(walk.unreached)})
        context = {
            "rows": page,
            "matching": walk.matching,
            "count_cap": figures.PAGE_COUNT_CAP,
            "scanned": None if walk.cut else figures.TEXT_SCAN_ROWS,
            "unreached": walk.unreached,
            "onward": onward,
            "fields": fields,
            "able": able,
        }
        return self.render(visit, "dead.html", context)

    async def dead_letter(self, request: requests.Request, visit: _Visit) -> responses.Response:
        dead_id = int(request.path_params["dead_id"])
        if dead_id > forms.MAX_ID:
            raise forms.Refused(404, "No such dead letter.")
        found, able = await self._run(lambda db: (figures.dead_letter(db, dead_id), figures.abilities(db)))
        if found is None:
            raise forms.Refused(404, f"No dead letter {dead_id} (retried or purged meanwhile?).")
        return self.render(visit, "dead_letter.html", {"row": found, "able": able})

    # --- actions ------------------------------------------------------------------------------

    async def confirm(self, request: requests.Request, visit: _Visit) -> responses.Response:
        chosen = forms.action(await self._acting_form(request, visit))
        # its count is of every match (a page's stops at PAGE_COUNT_CAP): the action's bound, not a page's
        matching, upto = await self._run(
            lambda db: admin.Admin(_able(db).conn, db.names).dead_extent(chosen.chosen), acting=True
        )
        context = {"chosen": chosen, "matching": matching, "upto": upto, "ids": list(chosen.chosen.ids or ())}
        return self.render(visit, "confirm.html", context)

    async def act(self, request: requests.Request, visit: _Visit) -> responses.Response:
        form = await self._acting_form(request, visit)
        chosen = forms.action(form)
        acted = await self._run(
            lambda db: figures.act(_able(db), chosen.verb, chosen.chosen, chosen.confirmed), acting=True
        )
        where = forms.query(chosen.fields)
        back = responses.RedirectResponse(f"/dead?{where}" if where else "/dead", status_code=303)
        if acted.changed is not None:
            log.info(
                "console: %s from %s: %s refused: %d dead letter(s) match, %s confirmed; filter %s",
                visit.operator,
                _client(request),
                chosen.verb,
                acted.changed,
                chosen.confirmed,
                forms.described(chosen),
            )
            counted = (
                "as many as the confirmation counted, but not the same ones"
                if acted.changed == chosen.confirmed
                else f"the confirmation counted {chosen.confirmed:,}"
            )
            visit.session.notice = (
                f"Nothing done: {acted.changed:,} dead letter(s) match now, {counted}. "
                "The set changed since the confirmation: confirm again."
            )
            return back
        done, refused, taken, staying = acted.done, acted.refused, acted.taken, acted.staying
        log.info(
            "console: %s from %s: %s %d dead letter(s) (%s confirmed, %d refused by the table, %d "
            "taken by another command, %d left as their job id is staged already); filter %s",
            visit.operator,
            _client(request),
            chosen.verb,
            done,
            forms.one(form, "confirmed") or "?",
            refused,
            taken,
            staying,
            forms.described(chosen),
        )
        verb = "staged again" if chosen.verb == "retry" else "purged"
        visit.session.notice = (
            f"{done:,} dead letter(s) {verb}."
            + (f" {refused:,} left: the table refuses them (they break its constraints)." if refused else "")
            + (f" {taken:,} skipped: another command held them at the same time." if taken else "")
            + (
                f" {staying:,} left: their job id is staged again already (a job of it waits in the table)."
                if staying
                else ""
            )
        )
        return back

    async def _acting_form(self, request: requests.Request, visit: _Visit) -> dict[str, Any]:
        """An action's form, once the request has shown it may act: an operator, this session's
        CSRF token, this origin."""
        if visit.operator is None:
            raise forms.Refused(403, "Read-only: sign in with the admin token to act.")
        form = await forms.read(request)
        if not self.access.csrf_ok(visit.session, forms.one(form, "csrf")):
            raise forms.Refused(
                403, "This form has expired (its CSRF token does not match): load the page again."
            )
        forms.same_origin(request)
        return form

    # --- signing in -------------------------------------------------------------------------

    async def login(self, request: requests.Request, visit: _Visit) -> responses.Response:
        if not self.access.signs_in:
            raise forms.Refused(404, "This console has no admin token: it is read-only.")
        if request.method == "GET":
            return self.render(visit, "login.html", {"failed": False})
        form = await forms.read(request)
        forms.same_origin(request)
        if not self.access.csrf_ok(visit.session, forms.one(form, "csrf")):
            raise forms.Refused(403, "This form has expired: load the page again.")
        name = text.inert(forms.one(form, "name") or "operator", 64)
        signed = self.access.sign_in(visit.session_id, forms.one(form, "token") or "", name)
        if signed is None:
            log.warning("console: a sign-in from %s failed (not the admin token)", _client(request))
            return self.render(visit, "login.html", {"failed": True}, 403)
        log.info("console: %s signed in from %s", name, _client(request))
        response = responses.RedirectResponse("/", status_code=303)
        _set_cookie(response, request, signed)
        return response

    async def logout(self, request: requests.Request, visit: _Visit) -> responses.Response:
        form = await forms.read(request)
        if self.access.csrf_ok(visit.session, forms.one(form, "csrf")):
            self.access.sign_out(visit.session_id)
        return responses.RedirectResponse("/", status_code=303)


def _able(db: store.Store) -> store.Store:
    """``db``, once this database lets the console act (Refused 409 saying why not)."""
    able = figures.abilities(db)
    if not able.may_act:
        raise forms.Refused(409, f"Read-only: {able.why_not}.")
    return db


def _failure(exc: Exception) -> str:
    """What a page says of a database failure; never the DSN (the log has the reason, redacted)."""
    if isinstance(exc, psycopg.errors.QueryCanceled):
        return f"The query took longer than {figures.PAGE_TIMEOUT_MS / 1000:g} s: narrow the filter."
    if isinstance(exc, errors.SchemaError):  # no table, or an older one: names the table only
        return f"{exc}."
    if isinstance(exc, errors.DrainError):  # cannot connect: the reason names the database
        log.warning("console: %s", exc)
        return "The database cannot be reached (the console's log says why)."
    log.warning("console: database error: %s", errors.first_line(exc))
    return f"Database error ({type(exc).__name__}); the console's log says more."
