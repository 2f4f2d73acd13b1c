"""The Redis keys the RQ and Celery backends share: Sentinel, and waiting for replicas.

RQ (the keys of RQ's own ``SENTINEL`` setting, in the backend's section)::

    sentinels = ["10.0.0.1:26379", "10.0.0.2:26379", "10.0.0.3:26379"]
    master_name = "mymaster"
    db = 0
    password = "${REDIS_PASSWORD}"           # the master's; username too (ACL)
    sentinel_password = "${SENTINEL_PASSWORD}"  # the sentinels'; sentinel_username too
    ssl = false                              # TLS to the master; sentinel_ssl to the sentinels

Celery (Celery's own spelling, as kombu's Sentinel transport reads it)::

    broker_url = "sentinel://:${REDIS_PASSWORD}@10.0.0.1:26379/0;sentinel://10.0.0.2:26379"
    broker_transport_options = {master_name = "mymaster", sentinel_kwargs = {password = "..."}}

Both: ``wait_replicas = N`` makes a batch acknowledged only once N replicas have it (Redis
``WAIT``, within ``wait_timeout_s``); fewer is an outage of the backend, and the rows wait.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Mapping
from typing import Any

import redis

from drain import errors
from drain.backend import options
from drain_adapters.redis import client as redis_client

DEFAULT_WAIT_TIMEOUT_S = 1.0
SENTINEL_SCHEME = "sentinel"
# kombu transport options that move the keys kombu reads: the drain writes kombu's defaults only
LAYOUT_OPTIONS = ("global_keyprefix", "priority_steps", "sep")
SENTINEL_KWARGS = ("username", "password", "ssl")
RQ_SENTINEL_ONLY: tuple[str, ...] = ("master_name", "db", "username", "password", "ssl")
RQ_SENTINEL_ONLY += ("sentinel_username", "sentinel_password", "sentinel_ssl")


@dataclasses.dataclass(frozen=True)
class Wait:
    """Acknowledge a batch only once ``replicas`` replicas have it (0: on the master's reply)."""

    replicas: int = 0
    timeout_s: float = DEFAULT_WAIT_TIMEOUT_S

    def ready(self, client: redis.Redis[bytes], label: str) -> None:
        """BackendUnavailable while the master has fewer online replicas than wanted (checked on
        open, so that a master left alone after a failover is not written to, and a batch not
        sent again, at every retry). Call inside ``redis_errors.translated``."""
        if not self.replicas:
            return
        info: Mapping[str, Any] = client.info("replication")
        online = sum(
            1
            for key, value in info.items()
            if key.startswith("slave") and isinstance(value, Mapping) and value.get("state") == "online"
        )
        if online < self.replicas:
            raise errors.BackendUnavailable(
                f"{label}: the master has {online} replicas online, wait_replicas wants {self.replicas}"
            )

    def check(self, client: redis.Redis[bytes], label: str) -> None:
        """Redis ``WAIT``; BackendUnavailable when fewer replicas acknowledged in time.
        Call inside ``redis_errors.translated``."""
        if not self.replicas:
            return
        self.verify(client.wait(self.replicas, self._timeout_ms), label)

    def command(self) -> bytes:
        """The ``WAIT`` command as the bytes Redis reads (empty without ``replicas``): sent
        right after a batch's call on the same connection, its reply is read after the call's."""
        if not self.replicas:
            return b""
        args = [b"WAIT", b"%d" % self.replicas, b"%d" % self._timeout_ms]
        return b"*3\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args)

    @property
    def _timeout_ms(self) -> int:
        return max(1, round(self.timeout_s * 1000))

    def verify(self, reply: Any, label: str) -> None:
        """BackendUnavailable when ``WAIT``'s reply counts fewer replicas than wanted."""
        acknowledged = int(reply)
        if acknowledged < self.replicas:
            raise errors.BackendUnavailable(
                f"{label}: {acknowledged} of the {self.replicas} replicas wanted (wait_replicas) "
                f"acknowledged the batch within {self.timeout_s:g} s"
            )


def read_wait(reader: options.OptionReader, socket_timeout_s: float, timeout_key: str) -> Wait:
    """``wait_replicas`` and ``wait_timeout_s``; WAIT's reply must come before ``timeout_key``'s
    socket timeout."""
    replicas = reader.integer("wait_replicas", 0, minimum=0)
    default = min(DEFAULT_WAIT_TIMEOUT_S, socket_timeout_s / 2)
    timeout_s = reader.number("wait_timeout_s", default, minimum=0.001)
    if timeout_s >= socket_timeout_s:
        reader.problem("wait_timeout_s", f"must be below {timeout_key} ({socket_timeout_s:g})")
    return Wait(replicas, timeout_s)


def read_rq_target(
    reader: options.OptionReader, values: Mapping[str, Any], default_url: str
) -> str | redis_client.SentinelTarget:
    """The RQ backend's ``url``, or its ``sentinels`` with the master's name and login
    (``values``: the section, to tell a key written from a default)."""
    addresses = reader.strings("sentinels")
    url = reader.string("url")
    master_name = reader.string("master_name")
    db = reader.integer("db", 0, minimum=0)
    username, password = reader.string("username"), reader.string("password")
    ssl = reader.boolean("ssl", False)
    sentinel_username = reader.string("sentinel_username")
    sentinel_password = reader.string("sentinel_password")
    sentinel_ssl = reader.boolean("sentinel_ssl", False)
    if addresses is None:
        for key in RQ_SENTINEL_ONLY:
            if values.get(key) is not None:
                reader.problem(key, "is only read with sentinels (a url carries its own)")
        url = url or default_url
        if not url.startswith(("redis://", "rediss://", "unix://")):
            reader.problem("url", "must be a redis://, rediss:// or unix:// URL (or give sentinels)")
        return url
    if url is not None:
        reader.problem("url", "cannot be combined with sentinels: the sentinels name the master")
    if master_name is None:
        reader.problem("master_name", "is required with sentinels")
    return redis_client.SentinelTarget(
        _addresses(reader, "sentinels", addresses),
        master_name or "",
        db=db,
        username=username,
        password=password,
        ssl=ssl,
        sentinel_username=sentinel_username,
        sentinel_password=sentinel_password,
        sentinel_ssl=sentinel_ssl,
    )


def _addresses(
    reader: options.OptionReader, key: str, texts: tuple[str, ...] | list[str]
) -> tuple[tuple[str, int], ...]:
    found: list[tuple[str, int]] = []
    for text in texts:
        try:
            found.append(redis_client.parse_address(text))
        except ValueError as exc:
            reader.problem(key, str(exc))
    if not texts:
        reader.problem(key, "must name at least one sentinel")
    return tuple(found)


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() == SENTINEL_SCHEME


def read_celery_target(reader: options.OptionReader, broker_url: str) -> str | redis_client.SentinelTarget:
    """Celery's Redis ``broker_url`` (``redis://``, or kombu's ``sentinel://...;sentinel://...``)
    with the ``broker_transport_options`` the drain honours. The login and database come from the
    first URL, as kombu reads them; the sentinels' own login from ``sentinel_kwargs``."""
    transport = reader.table("broker_transport_options")
    for key in LAYOUT_OPTIONS:
        if key in transport:
            reader.problem(
                "broker_transport_options",
                f"{key} is not supported: the drain writes where kombu's defaults put the messages",
            )
    if not is_sentinel_url(broker_url):
        return broker_url
    parts = [part.strip() for part in broker_url.split(";") if part.strip()]
    addresses: list[str] = []
    try:
        first = urllib.parse.urlsplit(parts[0])
        login = (first.username, first.password)
    except ValueError as exc:  # never repeat the URL: it may hold a password
        reader.problem("broker_url", f"is not a valid URL ({str(exc).split(':', 1)[0]})")
        first, login = urllib.parse.urlsplit(""), (None, None)
    for part in parts:
        scheme, _, rest = part.partition("://")
        if scheme.lower() != SENTINEL_SCHEME:
            reader.problem("broker_url", "mixes sentinel:// with other schemes")
            continue
        netloc = rest.split("/", 1)[0].rsplit("@", 1)[-1]
        addresses.append(netloc)
    database = first.path.lstrip("/")
    if database and not (database.isascii() and database.isdigit()):
        reader.problem("broker_url", "the Redis database (the first URL's path) must be a number")
    master_name = transport.get("master_name")
    if not isinstance(master_name, str) or not master_name:
        reader.problem(
            "broker_transport_options", "master_name (a non-empty string) is required with sentinel://"
        )
    sentinel_kwargs, others = _sentinel_options(reader, transport)
    return redis_client.SentinelTarget(
        _addresses(reader, "broker_url", addresses),
        master_name if isinstance(master_name, str) else "",
        db=int(database) if database.isascii() and database.isdigit() else 0,
        username=urllib.parse.unquote(login[0]) if login[0] else None,
        password=urllib.parse.unquote(login[1]) if login[1] else None,
        sentinel_username=_string(sentinel_kwargs.get("username")),
        sentinel_password=_string(sentinel_kwargs.get("password")),
        sentinel_ssl=bool(sentinel_kwargs.get("ssl", False)),
        min_other_sentinels=others,
    )


def _sentinel_options(
    reader: options.OptionReader, transport: Mapping[str, Any]
) -> tuple[Mapping[str, Any], int]:
    """``sentinel_kwargs`` and ``min_other_sentinels`` of ``broker_transport_options``, checked."""
    sentinel_kwargs = transport.get("sentinel_kwargs") or {}
    if (
        not isinstance(sentinel_kwargs, Mapping)
        or set(sentinel_kwargs) - set(SENTINEL_KWARGS)
        or not isinstance(sentinel_kwargs.get("ssl", False), bool)
    ):
        reader.problem(
            "broker_transport_options",
            f"sentinel_kwargs must be a table of {', '.join(SENTINEL_KWARGS)} (ssl true or false)",
        )
        sentinel_kwargs = {}
    others = transport.get("min_other_sentinels", 0)
    if isinstance(others, bool) or not isinstance(others, int) or others < 0:
        reader.problem("broker_transport_options", "min_other_sentinels must be an integer ≥ 0")
        others = 0
    return sentinel_kwargs, others


def _string(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
