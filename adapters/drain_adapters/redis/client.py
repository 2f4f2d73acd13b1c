"""How the Redis adapters reach Redis: a URL, or the master that Redis Sentinel names.

With Sentinel, redis-py asks the sentinels in turn for the master's address whenever a
connection is made (they share one socket timeout, each given its share, so asking them all
costs at most one timeout), and a connection that finds its master turned replica (READONLY) is
closed. The relay closes an adapter that found its backend unavailable and opens it again after
a pause, so after a failover the drain's next connection goes to the promoted master.

Every client, the sentinel ones included, is built with no retries of its own (redis-py gives a
client built from a host and port 10, which would multiply a wait and resend a transaction whose
reply was lost): one call costs at most one socket timeout, and the relay's pause-and-reopen is
the one retry loop. And with one connection:
the adapters call from one thread, and Redis ``WAIT`` counts the writes of the connection it is
sent on.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import redis
import redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

DEFAULT_SENTINEL_PORT = 26379
HEALTH_CHECK_INTERVAL_S = 30  # a connection idle this long is pinged before it is used
MIN_SENTINEL_TIMEOUT_S = 0.05


@dataclasses.dataclass(frozen=True)
class SentinelTarget:
    """The master named ``master_name`` by these sentinels, and how to log in to each."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    ssl: bool = False
    sentinel_username: str | None = None
    sentinel_password: str | None = dataclasses.field(default=None, repr=False)
    sentinel_ssl: bool = False
    min_other_sentinels: int = 0


def parse_address(text: str) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` as (host, port); ValueError says why not."""
    host, port = text.strip(), DEFAULT_SENTINEL_PORT
    if host.startswith("["):
        inside, _, rest = host[1:].partition("]")
        if not inside or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r} is not host:port")
        host, rest = inside, rest[1:]
        if rest:
            port = _port(rest, text)
    elif host.count(":") == 1:
        host, rest = host.split(":")
        port = _port(rest, text)
    if not host or any(char.isspace() or char in "/@" for char in host):
        raise ValueError(f"{text!r} is not host:port")
    return host, port


def _port(text: str, whole: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 65536:
        raise ValueError(f"{whole!r} has no valid port")
    return int(text)


class RedisLink:
    """One client (and, with Sentinel, the sentinel clients behind it); ``close`` closes all."""

    def __init__(self, target: str | SentinelTarget, timeout_s: float) -> None:
        """Build the clients; no I/O. ValueError for a URL redis-py refuses."""
        retry = Retry(NoBackoff(), 0)
        self._sentinel: redis.sentinel.Sentinel | None = None
        if isinstance(target, str):
            self.client: redis.Redis[bytes] = redis.Redis.from_url(
                target,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=retry,
                max_connections=1,
                health_check_interval=HEALTH_CHECK_INTERVAL_S,
            )
            return
        timeouts: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        each_s = max(timeout_s / max(len(target.sentinels), 1), MIN_SENTINEL_TIMEOUT_S)
        self._sentinel = redis.sentinel.Sentinel(
            list(target.sentinels),
            min_other_sentinels=target.min_other_sentinels,
            sentinel_kwargs={
                "socket_timeout": each_s,
                "socket_connect_timeout": each_s,
                "retry": retry,
                "username": target.sentinel_username,
                "password": target.sentinel_password,
                "ssl": target.sentinel_ssl,
            },
        )
        self.client = self._sentinel.master_for(
            target.master_name,
            db=target.db,
            username=target.username,
            password=target.password,
            ssl=target.ssl,
            retry=retry,
            max_connections=1,
            health_check_interval=HEALTH_CHECK_INTERVAL_S,
            **timeouts,
        )

    def call_packed(self, packed: bytes, command: str) -> Any:
        """Send one command packed by the caller (``packed``: the RESP bytes Redis reads) and
        return its parsed reply, as the client's own call would: on its one connection, health
        checked, a connection error or timeout closing it and raising (no retry), a READONLY
        master closing it too (Sentinel). redis-py packs each argument of a call on its own;
        a caller that knows its bytes (drain_adapters.rq.script.command) packs them in one pass."""
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([packed])
            return self.client.parse_response(conn, command)
        except (redis.ConnectionError, redis.TimeoutError):
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def close(self) -> None:
        """Close every connection; never raises."""
        with contextlib.suppress(Exception):
            self.client.close()
        for sentinel in self._sentinel.sentinels if self._sentinel is not None else ():
            with contextlib.suppress(Exception):
                sentinel.close()
