"""The one redaction: every password, wherever drain writes text, becomes ``***``.

- :func:`redact`: any text (a log message, an error, a traceback): the password of every
  ``scheme://user:password@`` URL and of every ``password=`` pair (libpq's ``key=value`` form,
  quoted or not), and any literal secret the caller names.
- :func:`redact_url`: one URL or DSN, for a repr or an error that names where drain connects;
  also a URL's ``password=`` query parameter, and each URL of a ``;``-separated list (Celery's
  failover ``broker_url``).
- :func:`redacted_repr`: a settings dataclass's repr with its URL field redacted.
- :func:`redact_value`: a log record's field, however nested.
- :func:`masked`: a configured value shown by ``drain check --show-config``: URLs redacted, and the
  whole value of any key whose name says secret (:func:`is_secret_name`).

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

# scheme://user:password@host -> scheme://user:***@host. The password runs to the last "@" of the
# whitespace-free run: a raw "@" in a password is redacted too (over-redacting a path is fine).
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^\s:@/]*):(?P<password>\S*)@(?=\S)")
# libpq key=value strings and error texts: password=secret, password = 'with spaces'
_PAIR_PASSWORD = re.compile(r"(?P<head>password\s*=\s*)(?P<password>'(?:[^'\\]|\\.)*'?|\S+)", re.IGNORECASE)
# a URL's query: ?password=secret&...
_QUERY_PASSWORD = re.compile(r"(password=)([^&#]*)", re.IGNORECASE)
# a key whose whole value is a secret (show-config): password, secret, token, key, credential...
_SECRET_NAME = re.compile(r"pass(?:word|wd|phrase)?|secret|token|credential|auth|(?:^|_)key(?:$|_)", re.I)
# keys whose name says key but whose value is no secret: the RabbitMQ backend's routing_key
# ("queue" or "ordering_key"), which --show-config would otherwise print as ***
_PLAIN_NAMES = frozenset({"routing_key"})


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with the password of every URL and every ``password=`` pair replaced by ``***``,
    and each of ``secrets`` (the passwords a caller knows, as an error may quote them bare)."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    if "://" in text:
        text = _URL_PASSWORD.sub(rf"\g<head>:{MASK}@", text)
    if "assword" in text or "ASSWORD" in text:
        text = _PAIR_PASSWORD.sub(rf"\g<head>{MASK}", text)
    return text


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***`` (for logs, reprs and errors).

    Both the URL's own password (``scheme://user:secret@host``) and a ``password=`` parameter
    (libpq's ``host=db password=secret`` form, quoted or not, or a URL's query) are hidden, in
    each URL of a ``;``-separated list (Celery's failover ``broker_url``).
    """
    if "://" not in url:
        return redact(url)  # libpq's key=value form
    several = url.split(";")
    if len(several) > 1 and all("://" in part for part in several):
        return ";".join(redact_url(part) for part in several)
    url = _QUERY_PASSWORD.sub(rf"\1{MASK}", url)
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:  # an unparseable netloc (a bad port, a bracket): hide all of it
        return re.sub(r"://[^/?#]*@", f"://{MASK}@", url)
    if password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = (parts.username or "") + f":{MASK}"
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}@{netloc[-1]}"))


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
        return {key: redact_value(item) for key, item in value.items()}
    if isinstance(value, int | float | bool) or value is None:
        return value
    return redact(str(value))  # an exception or any object: what the formatter would print


def is_secret_name(key: str) -> bool:
    """Whether a key's name says its value is a secret (password, secret, token, key, credential)."""
    return key.lower() not in _PLAIN_NAMES and _SECRET_NAME.search(key) is not None


def masked(value: Any) -> Any:
    """A configured value, safe to show: every string as :func:`redact_url` makes it, and the whole
    value of each mapping key whose name says secret ``***``, however nested."""
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, Mapping):
        return {key: MASK if is_secret_name(str(key)) else masked(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [masked(item) for item in value]
    return value
