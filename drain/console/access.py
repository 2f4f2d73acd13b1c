"""Who may act: read-only unless the console was given an admin credential.

Credentials
- A token (``DRAIN_CONSOLE_TOKEN``, or ``--token-file``): an operator signs in with it once; the
  comparison takes constant time; the token is never shown, logged or put in a cookie. A token
  file is read again when it changes (its modification time, size or inode): a rotated token
  ends the old one and every session signed in with it (a file that no longer holds a token:
  nobody signs in until it does).
- A hook, for an app that mounts the console: ``authorize(request)`` returns the operator's name
  when that request may act, None when it may only read.
- Neither: read-only, whoever asks.

Sessions
- A random id in a cookie (HttpOnly, SameSite=Strict), held in memory, a bounded number of them;
  signing in gives a new id (a session id seen before signing in is worth nothing after).
- Signed-in sessions are kept apart from the visitors' (each up to MAX_SESSIONS, the oldest
  going first): a flood of cookie-less requests, which any web page can send, signs nobody out.
- Each session has its own CSRF token; every action is a POST that carries it.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import os
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from drain import errors

COOKIE = "drain_console"
TOKEN_VARIABLE = "DRAIN_CONSOLE_TOKEN"
MIN_TOKEN_CHARS = 16
MAX_SESSIONS = 1_000  # of each kind; the oldest goes first beyond it: a flood costs bounded memory
SESSION_S = 8 * 3600.0  # a session older than this signs in again

Authorize = Callable[[Any], str | None]


def token_from(env: Mapping[str, str], path: str | None) -> str | None:
    """The admin token: the file's content (``--token-file``, stripped), else the environment's.

    Raises ConfigError for an unreadable file or a token shorter than MIN_TOKEN_CHARS; the error
    never quotes the token.
    """
    if path is not None:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise errors.ConfigError(f"console token file {path!r}: {type(exc).__name__}") from None
    else:
        token = env.get(TOKEN_VARIABLE, "").strip()
        if not token:
            return None
    if len(token) < MIN_TOKEN_CHARS:
        raise errors.ConfigError(f"the console's admin token must have at least {MIN_TOKEN_CHARS} characters")
    return token


@dataclasses.dataclass
class Session:
    """One visitor: its CSRF token, and who it acts as once signed in (None: read-only)."""

    csrf: str
    started: float
    operator: str | None = None
    notice: str | None = None  # what the last action did, shown once
    token_generation: int = 0  # the token it signed in with (Access._generation)


class Access:
    """The console's sessions and its one credential (a token or a hook; see the module)."""

    def __init__(
        self,
        *,
        token: str | None = None,
        authorize: Authorize | None = None,
        token_file: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if token is not None and authorize is not None:
            raise ValueError("one credential: a token or an authorize hook")
        self._token = token
        self._token_file = token_file  # the token's file, read again when it changes
        self._stamp = _stamp(token_file)
        self._generation = 0
        self._authorize = authorize
        self._clock = clock
        self._sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()  # visitors
        self._signed: collections.OrderedDict[str, Session] = collections.OrderedDict()  # operators

    @property
    def signs_in(self) -> bool:
        """Whether an operator signs in here (with the token)."""
        return self._token is not None or self._token_file is not None

    @property
    def read_only(self) -> bool:
        """Whether nobody may act (no credential)."""
        return self._token is None and self._authorize is None

    def session(self, session_id: str | None) -> tuple[str, Session]:
        """The session of this cookie value, or a new one (id, session)."""
        now = self._clock()
        found = self._signed.get(session_id or "") or self._sessions.get(session_id or "")
        if session_id is not None and found is not None and now - found.started < SESSION_S:
            return session_id, found
        if session_id is not None:
            self.sign_out(session_id)
        return self._new(now, self._sessions)

    @staticmethod
    def _new(now: float, kept: collections.OrderedDict[str, Session]) -> tuple[str, Session]:
        while len(kept) >= MAX_SESSIONS:
            kept.popitem(last=False)
        session_id = secrets.token_urlsafe(32)
        created = Session(csrf=secrets.token_urlsafe(32), started=now)
        kept[session_id] = created
        return session_id, created

    def operator(self, request: Any, session: Session) -> str | None:
        """Who this request acts as, or None: read-only."""
        if self._authorize is not None:
            return self._authorize(request)
        self._reread()
        return session.operator if session.token_generation == self._generation else None

    def sign_in(self, session_id: str, given: str, name: str) -> str | None:
        """A new session id acting as ``name`` when ``given`` is the token; None otherwise."""
        self._reread()
        if self._token is None or not hmac.compare_digest(given.encode(), self._token.encode()):
            return None
        self.sign_out(session_id)
        new_id, session = self._new(self._clock(), self._signed)
        session.token_generation = self._generation
        session.operator = name or "operator"
        return new_id

    def sign_out(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._signed.pop(session_id, None)

    def _reread(self) -> None:
        """The token file again, if it changed: a new token ends the sessions of the old one."""
        if self._token_file is None:
            return
        stamp = _stamp(self._token_file)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            token: str | None = token_from({}, self._token_file)
        except errors.ConfigError:
            token = None  # unreadable or too short: nobody signs in until it holds a token
        if token != self._token:
            self._token = token
            self._generation += 1
            self._signed.clear()

    @staticmethod
    def csrf_ok(session: Session, given: str | None) -> bool:
        """Whether a form carried this session's CSRF token."""
        return given is not None and hmac.compare_digest(given.encode(), session.csrf.encode())


def _stamp(path: str | None) -> tuple[int, int, int] | None:
    """What tells a file changed: its modification time, size and inode (None: no file)."""
    if path is None:
        return None
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_mtime_ns, found.st_size, found.st_ino
