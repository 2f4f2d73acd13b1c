"""The one redaction: every password, wherever drain writes text, becomes ``***``.

- :func:`redact`: any text (a log message, an error, a traceback): the password of every
  ``scheme://user:password@`` URL and of every ``password=`` pair (libpq's ``key=value`` form,
  quoted or not) and ``Pwd=`` pair (ODBC's), every fragment of the secrets the process was given
  (:func:`hide`), and any literal secret the caller names.
- :func:`fragments`: every piece of the password(s) a connection string's text holds, as a
  client library may quote one: the whole value raw, unescaped and percent-decoded, and each
  piece of it between spaces and delimiters, and each run of letters and digits, of
  MIN_FRAGMENT characters or more.
- :func:`hide`: remember a process's secrets (the DSN's and the backends' URLs'
  :func:`fragments`) so that every later :func:`redact` hides them, whichever text repeats them.
- :func:`redact_url`: one URL or DSN, for a repr or an error that names where drain connects;
  also a URL's ``password=`` query parameter, and each URL of a ``;``-separated list (Celery's
  failover ``broker_url``).
- :func:`redacted_repr`: a settings dataclass's repr with its URL field redacted.
- :func:`redact_value`: a log record's field, however nested.
- :func:`masked`: a configured value shown by ``drain check --show-config`` (and the arguments the
  console shows): every URL's password redacted wherever it stands in a string, keys as values,
  and the whole value of any key whose name says secret (:func:`is_secret_name`).

Imported by the relay, the config, the logs and the adapters alike, so it imports nothing of
drain's and no third-party library.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

MASK = "***"
MIN_FRAGMENT = 4
"""The shortest piece of a password :func:`fragments` returns: a shorter one would hide letters
of every word (the regular expressions of :func:`redact` still hide a short password where it
stands)."""

# scheme://user:password@host -> scheme://user:***@host. The password runs to the last "@" of the
# whitespace-free run: a raw "@" in a password is redacted too (over-redacting a path is fine).
# (URL_PASSWORD, PAIR_PASSWORD, SECRET_WORDS and NORMAL_DROP are also Postgres regular expressions:
# the console's text filters search what redact and masked leave, in SQL.)
# Whitespace is ASCII's, spelled out: Python's \s and Postgres's disagree on others (a no-break
# space is one to Python only), and what one redacts the other must too.
_SPACE = r" \t\n\r\f\v"
URL_PASSWORD = rf"([A-Za-z][A-Za-z0-9+.\-]*://[^{_SPACE}:@/]*):[^{_SPACE}]*@(?=[^{_SPACE}])"
_URL_PASSWORD = re.compile(URL_PASSWORD)  # as :func:`_url_passwords_masked` applies it, in linear time
_SPACE_CHAR = re.compile(f"[{_SPACE}]")
_SCHEME_CHARS = re.compile(r"[A-Za-z0-9+.\-]*")
_LETTER = re.compile("[A-Za-z]")
_USER_END = re.compile("[:@/]")
# libpq key=value strings, ODBC connection strings (Pwd=secret;) and error texts: password=secret,
# password = 'with spaces'
PAIR_WORD = "password|pwd"
PAIR_PASSWORD = rf"((?:{PAIR_WORD})[{_SPACE}]*=[{_SPACE}]*)(?:'(?:[^'\\]|\\.)*'?|[^{_SPACE}]+)"
_PAIR_PASSWORD = re.compile(PAIR_PASSWORD, re.IGNORECASE | re.DOTALL)  # "." takes a newline in Postgres
_PAIR_WORD = re.compile(PAIR_WORD, re.IGNORECASE)
# a URL's query: ?password=secret&... (or Pwd=, in a text holding a URL)
_QUERY_PASSWORD = re.compile(rf"((?:{PAIR_WORD})=)([^&#]*)", re.IGNORECASE)
# a key whose whole value is a secret (show-config, the console): its name holds one of these words
# once its letters are folded to lower case and everything but ASCII letters and digits is dropped
# (NORMAL_DROP): api_key, apiKey, X-Api-Key and "API key" alike. A "key" alone names no secret
# (ordering_key, keyboard, monkey): only as part of an API, private, secret, access or signing key.
SECRET_WORDS = (
    "pass|pwd|secret|token|apikey|privatekey|privkey|accesskey|signingkey|auth|credential|cookie"
    "|session|sessid|jwt|signature"
)
# What a name must hold to be masked, once normalized: SECRET_WORDS narrowed where a word also
# names settings that are no secret (a session's timeout, an author). The console's SQL looks for
# SECRET_WORDS, a superset: a row it sends to Python for nothing costs only time.
_SECRET_NAME = re.compile(
    "pass|pwd|secret|token|apikey|privatekey|privkey|accesskey|signingkey|auth$|authoriz|authkey"
    "|authheader|credential|cookie|^session$|sessionid|sessionkey|sessid|jwt|signature"
)
# the letters re.IGNORECASE and str.lower() fold to an ASCII one and Postgres's ~* does not (long s,
# Kelvin sign, dotted and dotless i): folded first, here and by the console's filters in Postgres
FOLDED = {"\u017f": "s", "\u212a": "k", "\u0130": "i", "\u0131": "i"}
_FOLD = str.maketrans(FOLDED)
# what a name loses before SECRET_WORDS is looked for in it (spelled out: a range is Unicode's order
# in Python, and what Postgres drops from the arguments' text must be at least this)
NORMAL_DROP = "[^0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ]"
_NORMAL_DROP = re.compile(NORMAL_DROP)
# libpq's key=value form: the start of a pair, and where an unquoted value ends (as libpq reads
# it: at the next whitespace-separated word followed by "=")
_PAIR_START = re.compile(r"(?:^|\s)password\s*=\s*", re.IGNORECASE)
_NEXT_PAIR = re.compile(r"(?<!\s)\s+[A-Za-z_][A-Za-z0-9_]*\s*=")  # tried once per run of spaces
# where libpq splits a URL or a value: whitespace and the URL's delimiters
_DELIMITERS = re.compile(r"[\s:/@?&=#;,]+")
_WORD = re.compile(r"[^\W_]+")
_QUOTED = re.compile(r"'((?:[^'\\]|\\.)*)'?")
_hidden: set[str] = set()


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with the password of every URL and every ``password=`` pair replaced by ``***``,
    and each of ``secrets`` (the passwords a caller knows, as an error may quote them bare)."""
    if "://" in text:
        text = _url_passwords_masked(text)
    if _PAIR_WORD.search(text):  # any case, as the pattern (and Postgres's copy of it, 'gi')
        text = _PAIR_PASSWORD.sub(rf"\1{MASK}", text)
    return _hidden_in(text, secrets)


def _url_passwords_masked(text: str) -> str:
    """``_URL_PASSWORD.sub(rf"\\1:{MASK}@", text)``, in time linear in ``text``'s length.

    The regular expression retries the rest of a whitespace-free run from every start; this finds
    its one match per run directly. A match stays in its run, and its greedy ``[^ws]*@`` ends at
    the run's last "@" followed by a character: so a run without one holds no match, and a match
    takes the rest of the run up to it (none follows). It starts at the first letter of the
    scheme characters before the run's first "://" whose user part (up to the first ``:@/``)
    ends at a ":" before that "@".
    """
    found = text.find("://")
    if found < 0 or "@" not in text:
        return text
    pieces: list[str] = []
    copied = 0
    backwards = ""
    while found >= 0:
        space = _SPACE_CHAR.search(text, found + 3)
        end = space.start() if space else len(text)
        at = text.rfind("@", found, end - 1)
        while 0 <= found < at:
            backwards = backwards or text[::-1]
            behind = _SCHEME_CHARS.match(backwards, len(text) - found)  # the scheme's characters
            scheme = len(text) - behind.end() if behind else found
            letter = _LETTER.search(text, scheme, found)
            user = _USER_END.search(text, found + 3, end)
            if letter and user and text[user.start()] == ":" and user.start() < at:
                pieces += [text[copied : letter.start()], text[letter.start() : user.start()], f":{MASK}@"]
                copied = at + 1
                break
            found = text.find("://", found + 3, at)
        found = text.find("://", end)
    return "".join([*pieces, text[copied:]]) if pieces else text


def _hidden_in(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each of ``secrets`` and of the hidden ones ``***``, the longest first (after
    the patterns: a piece may be part of the word ``password``)."""
    for secret in sorted({*secrets, *_hidden}, key=len, reverse=True):
        if secret:
            text = text.replace(secret, MASK)
    return text


def hide(secrets: Iterable[str]) -> None:
    """From now on every :func:`redact` in this process hides each of ``secrets`` (for a command:
    the :func:`fragments` of its DSN and its backends' URLs, so that no log line, error or
    traceback shows a piece of them, whatever a client library quoted). Replaces the secrets an
    earlier call named."""
    _hidden.clear()
    _hidden.update(secret for secret in secrets if secret)


def hidden() -> list[str]:
    """The secrets :func:`hide` named, that every :func:`redact` hides."""
    return sorted(_hidden)


def redact_cut(text: str) -> str:
    """:func:`redact` for text cut short: a hidden secret's beginning at its very end is hidden
    too (the rest of that secret was cut off, so no secret matches what is left)."""
    for secret in sorted(_hidden, key=len, reverse=True):
        for length in range(min(len(secret) - 1, len(text)), 0, -1):
            if text.endswith(secret[:length]):
                return redact(text[:-length]) + MASK
    return redact(text)


def hidden_by_term(term: str) -> bool:
    """Whether a search term holds one of the hidden secrets (any case): a filter searching for
    it could only find what :func:`redact` hides. (Not a term within a secret: that it finds
    nothing would tell a visitor which pieces the secret holds.)"""
    folded = term.casefold()
    return any(secret.casefold() in folded for secret in _hidden if folded)


def fragments(dsn: str) -> list[str]:
    """Every piece of the password(s) in ``dsn``'s text that an error could quote, longest first.

    The password is found by the text alone, so this holds for a DSN no library can parse:

    - URL form: between the user's ``:`` and the last ``@`` (libpq may read a raw ``@``, ``/`` or
      ``?`` of a password as a host, a port or a database), and a ``password=`` query parameter.
    - key=value form: a quoted value to its closing quote; an unquoted one up to the next
      ``word=`` (where libpq starts the next key), spaces included.

    Of each: the value raw, with its backslash escapes undone and percent-decoded, each piece
    between whitespace and URL delimiters, and each run of letters and digits: each of
    MIN_FRAGMENT characters or more.
    """
    values = _url_passwords(dsn) if "://" in dsn else _pair_passwords(dsn)
    found: set[str] = set()
    for value in values:
        forms = {value, re.sub(r"\\(.)", r"\1", value), urllib.parse.unquote(value, errors="replace")}
        for form in forms:
            found.update([form, *_DELIMITERS.split(form), *form.split(), *_WORD.findall(form)])
    shown = _without(dsn, values)
    return sorted(
        (piece for piece in found if len(piece) >= MIN_FRAGMENT and (piece in values or piece not in shown)),
        key=len,
        reverse=True,
    )


def _without(text: str, passwords: list[str]) -> str:
    """``text`` with its passwords cut out: what it shows anyway (user, host, database, options).
    A piece of a password that stands there too is not hidden: hiding it would mask the host or
    the database an operator reads, and tell anyone who knows them what the password holds."""
    gone = set()  # a password without a space, once replaced, cannot stand there again
    for password in sorted(passwords, key=len, reverse=True):
        if password and password not in gone:
            text = text.replace(password, " ")
            if " " not in password:
                gone.add(password)
    return text


def _url_passwords(text: str) -> list[str]:
    found = [match.group(2) for match in _QUERY_PASSWORD.finditer(text)]
    several = text.split(";")
    for url in several if all("://" in part for part in several) else [text]:
        authority = url.split("://", 1)[-1]
        if "@" in authority:
            userinfo = authority.rsplit("@", 1)[0]
            if ":" in userinfo:
                found.append(userinfo.split(":", 1)[1])
    return found


def _pair_passwords(text: str) -> list[str]:
    found = []
    for start in _PAIR_START.finditer(text):
        value = start.end()  # searched in place: a copy of the rest per pair is quadratic
        quoted = _QUOTED.match(text, value)
        if quoted:
            found.append(quoted.group(1))
        else:
            end = _NEXT_PAIR.search(text, value)
            found.append(text[value : end.start() if end else len(text)].strip())
    return found


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***`` (for logs, reprs and errors).

    Both the URL's own password (``scheme://user:secret@host``) and a ``password=`` parameter
    (libpq's ``host=db password=secret`` form, quoted or not, or a URL's query) are hidden, in
    each URL of a ``;``-separated list (Celery's failover ``broker_url``); and so is each of its
    password's :func:`fragments`, wherever it stands (in a DSN no library can parse too).
    """
    return _hidden_in(_redact_url(url), fragments(url))


def _redact_url(url: str) -> str:
    if "://" not in url:
        return redact(url)  # libpq's key=value form
    several = url.split(";")
    if len(several) > 1 and all("://" in part for part in several):
        return ";".join(_redact_url(part) for part in several)
    url = _QUERY_PASSWORD.sub(rf"\1{MASK}", url)
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:  # an unparseable netloc (a bad port, a bracket): hide all of it
        return _url_passwords_masked(re.sub(r"://[^/?#]*@", f"://{MASK}@", url))
    if password is not None:
        netloc = parts.netloc.rsplit("@", 1)
        user = (parts.username or "") + f":{MASK}"
        url = urllib.parse.urlunsplit(parts._replace(netloc=f"{user}@{netloc[-1]}"))
    # and every URL that stands inside the text (after a word, a "=", a bracket), whatever its
    # password's length, as redact hides them
    return _url_passwords_masked(url)


def redacted_repr(settings: Any, url_field: str) -> str:
    """The dataclass repr of ``settings`` with the password in its ``url_field`` redacted."""
    fields = ", ".join(
        f"{field.name}={getattr(settings, field.name)!r}"
        for field in dataclasses.fields(settings)
        if field.name != url_field and field.repr
    )
    url = redact_url(getattr(settings, url_field))
    return f"{type(settings).__name__}({url_field}={url!r}, {fields})"


def redact_value(value: Any) -> Any:
    """A log record's message or field: strings redacted inside lists, tuples and mappings;
    numbers, booleans and None as they are; any other object as its redacted ``str``."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list | tuple):
        return type(value)(redact_value(item) for item in value)
    if isinstance(value, Mapping):
        return _each_kept(
            (redact(key) if isinstance(key, str) else key, redact_value(item)) for key, item in value.items()
        )
    if isinstance(value, int | float | bool) or value is None:
        return value
    return redact(str(value))  # an exception or any object: what the formatter would print


def is_secret_name(key: str) -> bool:
    """Whether a key's name says its value is a secret, in any case and whatever separates its
    words (``db_pwd``, ``apiKey``, ``X-Api-Key``, ``sessionid``, ``auth``; not ``session_timeout``
    or ``author``)."""
    return _SECRET_NAME.search(_NORMAL_DROP.sub("", key.translate(_FOLD).lower())) is not None


def masked(value: Any) -> Any:
    """A configured value, safe to show: every string as :func:`redact_url` makes it (every URL's
    password in it, a ``password=`` or ``Pwd=`` pair's), each mapping key too, the whole value
    of each key whose name says secret ``***``, however nested, and a number that shows one of
    the process's own secrets ``***``."""
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, Mapping):
        return _each_kept(
            (masked(key) if isinstance(key, str) else key, MASK if is_secret_name(str(key)) else masked(item))
            for key, item in value.items()
        )
    if isinstance(value, list | tuple):
        return [masked(item) for item in value]
    if isinstance(value, int | float) and not isinstance(value, bool) and _hidden:
        shown = str(value)  # as a page or a log line writes a number: a secret may be digits
        return MASK if redact(shown) != shown else value
    return value


def _each_kept(pairs: Iterable[tuple[Any, Any]]) -> dict[Any, Any]:
    """A mapping of ``pairs``, each kept: a key masked to the text of an earlier one (two URLs but
    for their passwords) gets one more ``*`` until it stands apart (only ``*``: so a term touching
    what was added holds a ``*``, which the console's filters search where masking touched a row)."""
    kept: dict[Any, Any] = {}
    for key, item in pairs:
        shown = key
        while shown in kept and isinstance(shown, str):
            shown += "*"
        kept[shown] = item
    return kept
