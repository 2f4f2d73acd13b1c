"""What a request asks, read and checked: the filter of a dead-letter page, an action's form.

A value the console cannot use is a Refused (its status and the sentence the page says), never
a guess: a time that is no time, a filter longer than MAX_FILTER_CHARS or holding a NUL, an id
beyond bigint.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from starlette import requests

from drain.store import admin

MAX_FORM_BYTES = 64 * 1024
MAX_FILTER_CHARS = 1_000
MAX_ID = 2**63 - 1  # bigint
TEXT_FILTERS = ("job_name", "backend", "queue", "ordering_key", "error", "arg")
FILTERS = (*TEXT_FILTERS, "since", "until", "start")  # start: the newest dead_id a page reads
ACTIONS = ("retry", "purge")
DIGEST = re.compile(r"[0-9a-f]{64}")


class Refused(Exception):
    """A request the console turns down: its status and the sentence the page says."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read(request: requests.Request) -> dict[str, Any]:
    """An urlencoded form, at most MAX_FORM_BYTES: each field's last value (``id``: all of them)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise Refused(413, "This form is too large.")
    try:
        parsed = urllib.parse.parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=1_000)
    except (UnicodeDecodeError, ValueError):
        raise Refused(400, "This form could not be read.") from None
    return {key: values if key == "id" else values[-1] for key, values in parsed.items()}


def one(form: Mapping[str, Any], key: str) -> str | None:
    value = form.get(key)
    return value if isinstance(value, str) else None


def same_origin(request: requests.Request) -> None:
    """A form posted from another origin is refused (besides SameSite cookies and CSRF)."""
    origin = request.headers.get("origin")
    if origin is not None and urllib.parse.urlsplit(origin).netloc != request.headers.get("host"):
        raise Refused(403, "This form was sent from another site.")


def filters(params: Mapping[str, Any]) -> tuple[dict[str, str], admin.DeadFilter]:
    """The filter's fields as given (to fill the form again) and as a DeadFilter."""
    fields = {name: str(params.get(name) or "").strip() for name in FILTERS}
    for name, value in fields.items():
        if len(value) > MAX_FILTER_CHARS:
            raise Refused(400, f"The filter {name} is longer than {MAX_FILTER_CHARS} characters.")
        if "\x00" in value:  # Postgres's text cannot hold it: no dead letter does
            raise Refused(400, f"The filter {name} holds a NUL character.")
    chosen = admin.DeadFilter(
        job_name=fields["job_name"] or None,
        backend=fields["backend"] or None,
        queue=fields["queue"] or None,
        ordering_key=fields["ordering_key"] or None,
        error=fields["error"] or None,
        arg=fields["arg"] or None,
        since=_time(fields["since"], "since"),
        until=_time(fields["until"], "until"),
        upto=_number(fields["start"], "start"),
    )
    return fields, chosen


def query(fields: Mapping[str, str]) -> str:
    """The filter as a query string: ``/dead?...`` shows the same dead letters again."""
    return urllib.parse.urlencode({name: value for name, value in fields.items() if value})


def _number(value: str, name: str) -> int | None:
    """A dead letter's number (``start``: where a page's walk begins, the one before it stopped)."""
    if not value:
        return None
    if not (value.isascii() and value.isdigit()) or int(value) > MAX_ID:  # not '²', nor another script's
        raise Refused(400, f"The filter {name} is no dead letter's number.")
    return int(value)


def _time(value: str, name: str) -> datetime.datetime | None:
    """A filter's time: ISO 8601 (a form's ``datetime-local``), UTC unless it says otherwise."""
    if not value:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise Refused(400, f"The filter {name} is no time (ISO 8601, e.g. 2026-01-31T14:00).") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=datetime.UTC)


@dataclasses.dataclass(frozen=True)
class Action:
    """What an action's form asks: retry or purge, the filter's fields, the dead letters it
    applies to (those matching the filter, or the selected ones among them), as posted."""

    verb: str
    fields: dict[str, str]
    chosen: admin.DeadFilter
    posted: str  # the form's action value, posted again by the confirmation
    confirmed: int | None = None  # what the confirmation counted: the act takes that set or none


def action(form: Mapping[str, Any]) -> Action:
    """``retry`` / ``purge``: everything matching; ``retry:selected`` / ``purge:selected``: the
    ``id`` values among them; ``upto``, ``confirmed`` and ``digest`` (posted by the
    confirmation): none beyond the highest dead_id it counted, and none at all unless the very set
    it counted matches (as many, and with ``digest``, admin.Counted, the same ones). A digest that
    is none the confirmation makes matches no set: the act takes none."""
    posted = one(form, "action") or ""
    verb, _, scope = posted.partition(":")
    if verb not in ACTIONS or scope not in ("", "selected"):
        raise Refused(400, "No such action.")
    fields, chosen = filters(form)
    if scope == "selected":
        try:
            ids = sorted({int(value) for value in form.get("id", [])})
        except ValueError:
            raise Refused(400, "A selected dead letter is no number.") from None
        if not ids:
            raise Refused(400, "Nothing selected.")
        if not all(0 < dead_id <= MAX_ID for dead_id in ids):
            raise Refused(400, "A selected dead letter is no dead letter's number.")
        chosen = dataclasses.replace(chosen, ids=ids)
    upto = _number(one(form, "upto") or "", "upto")
    if upto is not None:  # never beyond the page's own start: the count was of those below it
        chosen = dataclasses.replace(chosen, upto=upto if chosen.upto is None else min(upto, chosen.upto))
    confirmed = _number(one(form, "confirmed") or "", "confirmed")
    counted = one(form, "digest")
    if confirmed is not None and counted is not None:
        confirmed = admin.Counted(confirmed, counted if DIGEST.fullmatch(counted) else "")
    return Action(verb, fields, chosen, posted, confirmed)


def described(chosen: Action) -> str:
    """The action's filter on one line, for the log."""
    shown: dict[str, str] = {name: value for name, value in chosen.fields.items() if value}
    ids = list(chosen.chosen.ids or ())
    if ids:
        shown["ids"] = ",".join(map(str, ids[:20])) + ("..." if len(ids) > 20 else "")
    if chosen.chosen.upto is not None:
        shown["upto"] = str(chosen.chosen.upto)
    return repr(shown) if shown else "(everything)"
