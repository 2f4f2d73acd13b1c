"""The NATS backend's settings (``[backends.<name>]`` with ``type = "nats"``) and the one function
that turns an error into text safe to log: no password, token or key.

A section::

    [backends.events]
    type = "nats"
    url = ["nats://10.0.0.1:4222", "nats://10.0.0.2:4222", "nats://10.0.0.3:4222"]
    subject_prefix = "jobs"             # a job of queue "email" goes to subject "jobs.email"
    queues = ["email", "reports"]       # checked at start: a stream must cover each one's subject
    user = "drain"                      # or token = "...", or nkey_seed_file, or creds_file
    password = "${NATS_PASSWORD}"
    tls_ca_file = "/etc/drain/nats-ca.pem"

Credentials come from the section (the ``${NAME}`` form reads them from the environment) or from
a URL's user information (``nats://user:password@host``; a token only in ``token``); they are kept
out of ``repr`` and of every error. A ``tls://`` URL, ``tls = true`` or a server that requires
TLS makes the connection TLS.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Mapping
from typing import Any

from drain import errors
from drain.backend import options
from drain.observability.redaction import redact  # the one redaction

DEFAULT_URL = "nats://127.0.0.1:4222"
DEFAULT_PORT = 4222
DEFAULT_SUBJECT_PREFIX = "jobs"
DEFAULT_INBOX_PREFIX = "_INBOX"
SCHEMES = ("nats", "tls")
WILDCARDS = ("*", ">")


@dataclasses.dataclass(frozen=True)
class Server:
    """One server of the cluster, as the settings name it (no credentials)."""

    host: str
    port: int = DEFAULT_PORT
    tls: bool = False

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclasses.dataclass(frozen=True)
class NatsSettings:
    """``[backends.<name>]`` with ``type = "nats"``.

    ``servers``: the cluster's servers (``url`` in the file: one URL, a list, or URLs separated
    by ``,``), tried in turn. ``queues``: the queues whose subjects ``open`` checks a stream
    covers (without them, it checks that some stream takes subjects under ``subject_prefix``).
    """

    servers: tuple[Server, ...] = (Server("127.0.0.1"),)
    subject_prefix: str = DEFAULT_SUBJECT_PREFIX
    queues: tuple[str, ...] = ()
    inbox_prefix: str = DEFAULT_INBOX_PREFIX
    publish_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    user: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    token: str | None = dataclasses.field(default=None, repr=False)
    nkey_seed_file: str | None = None
    creds_file: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    @property
    def secrets(self) -> tuple[str, ...]:
        return tuple(secret for secret in (self.password, self.token) if secret)

    @classmethod
    def parse(cls, name: str, values: Mapping[str, Any], publish_timeout_s: float) -> NatsSettings:
        """Read the section; raise ConfigError naming every bad key at once. No I/O."""
        reader = options.OptionReader(values, f"backends.{name}.")
        timeout = reader.timeout("publish_timeout_s", publish_timeout_s, publish_timeout_s)
        urls = reader.string_or_strings("url") or (DEFAULT_URL,)
        parts = [part.strip() for url in urls for part in url.split(",") if part.strip()]
        servers, login = read_servers(reader, parts)
        user = reader.string("user") or login.get("user")
        password = reader.string("password") or login.get("password")
        token = reader.string("token") or login.get("token")
        settings = cls(
            servers=servers,
            subject_prefix=reader.string("subject_prefix", DEFAULT_SUBJECT_PREFIX) or DEFAULT_SUBJECT_PREFIX,
            queues=reader.strings("queues") or (),
            inbox_prefix=reader.string("inbox_prefix", DEFAULT_INBOX_PREFIX) or DEFAULT_INBOX_PREFIX,
            publish_timeout_s=float(timeout),
            connect_timeout_s=reader.timeout("connect_timeout_s", min(5.0, timeout), publish_timeout_s),
            user=user,
            password=password,
            token=token,
            nkey_seed_file=reader.string("nkey_seed_file"),
            creds_file=reader.string("creds_file"),
            tls=reader.boolean("tls", False),
            tls_ca_file=reader.string("tls_ca_file"),
            tls_cert_file=reader.string("tls_cert_file"),
            tls_key_file=reader.string("tls_key_file"),
        )
        settings.check(reader)
        problems = reader.finish()
        if problems:
            raise errors.ConfigError(problems)
        return settings

    def check(self, reader: options.OptionReader) -> None:
        """Record in ``reader`` what is wrong with these values together."""
        for key, value in (("subject_prefix", self.subject_prefix), ("inbox_prefix", self.inbox_prefix)):
            problem = subject_problem(value)
            if problem:
                reader.problem(key, problem)
        for queue in self.queues:
            problem = subject_problem(queue)
            if problem:
                reader.problem("queues", f"{queue[:40]!r}: {problem}")
        ways = [
            key
            for key, value in (
                ("user", self.user),
                ("token", self.token),
                ("nkey_seed_file", self.nkey_seed_file),
                ("creds_file", self.creds_file),
            )
            if value
        ]
        if len(ways) > 1:
            reader.problem(ways[1], f"is one way to log in, and {ways[0]} another: choose one")
        if self.password and not self.user:
            reader.problem("password", "needs user")
        if self.user and not self.password:
            reader.problem("user", "needs password")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            reader.problem("tls_cert_file", "and tls_key_file go together (a client certificate)")

    @property
    def wants_tls(self) -> bool:
        return self.tls or bool(self.tls_ca_file or self.tls_cert_file)

    def describe(self, error: BaseException | str) -> str:
        """``error`` as one line of text with every password and token masked."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {str(error) or repr(error)}"
        return redact(" ".join(text.split()), self.secrets)


def read_servers(reader: options.OptionReader, urls: list[str]) -> tuple[tuple[Server, ...], dict[str, str]]:
    """The servers of ``url``, and the login the URLs carry (a user and a password)."""
    servers: list[Server] = []
    login: dict[str, str] = {}
    for url in urls:
        try:
            parts = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
            port = parts.port or DEFAULT_PORT
        except ValueError:
            reader.problem("url", "is not a URL (nats://host:port)")
            continue
        if parts.scheme not in SCHEMES or not parts.hostname:
            reader.problem("url", "must be nats://host:port or tls://host:port, or a list of them")
            continue
        if parts.username and parts.password is not None:
            login.update(
                user=urllib.parse.unquote(parts.username), password=urllib.parse.unquote(parts.password)
            )
        elif parts.username:
            reader.problem(
                "url",
                "carries a token as its user, which a URL shown or logged would reveal: "
                'give it as token = "${NATS_TOKEN}" instead',
            )
        servers.append(Server(parts.hostname, port, parts.scheme == "tls"))
    return tuple(servers) or (Server("127.0.0.1"),), login


def subject_problem(subject: str) -> str | None:
    """Why ``subject`` cannot be a literal NATS subject (or a part of one), or None.

    Tokens separated by ``.``: none empty, none a wildcard (``*``, ``>``), no whitespace or
    control character anywhere (the protocol separates its fields by them), valid UTF-8.
    """
    if not subject:
        return "is empty"
    try:
        subject.encode()
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    if any(char.isspace() or ord(char) < 0x20 or ord(char) == 0x7F for char in subject):
        return "holds whitespace or a control character, which a NATS subject cannot"
    tokens = subject.split(".")
    if any(not token for token in tokens):
        return "has an empty token (a leading, trailing or doubled '.')"
    if any(token in WILDCARDS for token in tokens):
        return "has a wildcard token ('*' or '>'), which a published subject cannot"
    return None
