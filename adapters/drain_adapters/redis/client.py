"""How the Redis adapters reach Redis: a URL, or the master that Redis Sentinel names.

With Sentinel, redis-py asks the sentinels in turn for the master's address whenever a
connection is made (they share one socket timeout, each given its share, so asking them all
costs at most one timeout), and a connection that finds its master turned replica (READONLY) is
closed. The relay closes an adapter that found its backend unavailable and opens it again after
a pause, so after a failover the drain's next connection goes to the promoted master.

Every client, the sentinel ones included, is built with no retries of its own (redis-py gives a
client built from a host and port 10, which would multiply a wait and resend a transaction whose
reply was lost): one call costs at most one socket timeout, and the relay's pause-and-reopen is
the one retry loop. Every wait on a connection's socket (connecting, each handshake reply, a
command's write and reply) is also bounded by what is left of the adapter's call
(``drain.backend.deadline``): a link slow enough to answer each wait just in time fails the call
at its deadline instead of stretching it round trip by round trip. And with one connection:
the adapters call from one thread, and Redis ``WAIT`` counts the writes of the connection it is
sent on.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any

import redis
import redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

from drain.backend import deadline as call_deadline

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


PASSED = "the call's deadline passed"


def _bounded(connection_class: type[Any], deadline: call_deadline.Deadline) -> type[Any]:
    """``connection_class`` (the one redis-py chose for the URL or Sentinel) whose every socket
    wait is also bounded by ``deadline``; past it the connection is dropped and TimeoutError
    raised, as redis-py does when its own socket timeout passes."""

    class Bounded(connection_class):  # type: ignore[misc]
        def _wait_s(self, own_s: float | None) -> float:
            wait_s = deadline.bound(own_s)
            if wait_s is None:
                self.disconnect()
                raise redis.TimeoutError(PASSED)
            return wait_s

        def _connect(self) -> Any:
            me: Any = self  # redis-py is typed by its stubs only in part
            if not hasattr(me, "_own_s"):
                me._own_s = (me.socket_connect_timeout, me.socket_timeout)
            me.socket_connect_timeout = self._wait_s(me._own_s[0])
            me.socket_timeout = self._wait_s(me._own_s[1])
            return super()._connect()

        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            if self._sock is not None:
                self._sock.settimeout(self._wait_s(self._own_s[1]))
            super().send_packed_command(command, check_health)

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            if self._sock is not None:  # past the deadline, a reply already come is read
                self._sock.settimeout(deadline.read_bound(self._own_s[1]))
            return super().read_response(*args, **kwargs)

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{connection_class.__name__}"
    return Bounded


class RedisLink:
    """One client (and, with Sentinel, the sentinel clients behind it); ``close`` closes all.
    ``deadline``: the adapter's call under way, bounding every wait of the client's connection."""

    def __init__(
        self, target: str | SentinelTarget, timeout_s: float, deadline: call_deadline.Deadline | None = None
    ) -> None:
        """Build the clients; no I/O. ValueError for a URL redis-py refuses."""
        retry = Retry(NoBackoff(), 0)
        self._sentinel: redis.sentinel.Sentinel | None = None
        self.deadline = deadline or call_deadline.Deadline(timeout_s)
        if isinstance(target, str):
            self.client: redis.Redis[bytes] = redis.Redis.from_url(
                target,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=retry,
                max_connections=1,
                health_check_interval=HEALTH_CHECK_INTERVAL_S,
            )
            self._bound()
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
        self._bound()

    def _bound(self) -> None:
        pool = self.client.connection_pool
        pool.connection_class = _bounded(pool.connection_class, self.deadline)

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


class Pipe:
    """A link's connection whose replies are read later, in the order their commands went.

    Redis answers one connection's commands in order, so a batch's call can be sent now and its
    reply read a step later (``send``, then ``read``). A connection lost or closed ends a
    generation: ``read`` for an older one raises Lost, and no reply of the new connection ever
    answers it. Before each ``send`` the replies already come are read, so a connection the
    server closed is noticed there and the command goes on a new one.
    """

    class Lost(Exception):
        """The connection that carried the command is gone; its reply never comes."""

    def __init__(self, link: RedisLink) -> None:
        self._link = link
        self._conn: Any = None
        self._owed = 0  # replies not read yet, those read early included
        self._early: collections.deque[Any] = collections.deque()  # read, not handed out yet
        self.generation = 0

    def connect(self) -> None:
        """Make the connection now (its handshake a round trip) if there is none."""
        if self._conn is None:
            self._conn = self._link.client.connection_pool.get_connection()

    def send(self, packed: bytes, replies: int) -> int:
        """Send the commands ``packed`` (``replies`` of them); return their generation. A
        connection error or timeout drops the connection and raises."""
        if self._conn is not None and self._owed > len(self._early):
            self._read_early()
        self.connect()
        try:
            self._conn.send_packed_command([packed], check_health=self._owed == 0)
        except (redis.ConnectionError, redis.TimeoutError):
            self.drop()
            raise
        self._owed += replies
        return self.generation

    def read(self, generation: int) -> Any:
        """The next reply owed to ``generation`` (an error reply raised as redis-py raises it);
        Lost when that generation's connection is gone. A connection error or timeout drops the
        connection and raises."""
        if generation != self.generation or self._conn is None or not self._owed:
            raise Pipe.Lost()
        try:
            reply = self._early.popleft() if self._early else self._one()
        except (redis.ConnectionError, redis.TimeoutError):
            self.drop()
            raise
        self._owed -= 1
        if isinstance(reply, redis.ResponseError):
            raise reply
        return reply

    def close(self) -> None:
        """Drop the connection and close the link's clients; never raises."""
        self.drop()
        self._link.close()

    def drop(self) -> None:
        """Close the connection; every reply still owed is lost. Never raises."""
        conn, self._conn = self._conn, None
        self._owed = 0
        self._early.clear()
        self.generation += 1
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.disconnect()
            with contextlib.suppress(Exception):
                self._link.client.connection_pool.release(conn)

    def _one(self) -> Any:
        try:
            return self._conn.read_response()
        except redis.ResponseError as exc:  # an error reply is the command's answer
            return exc

    def _read_early(self) -> None:
        """Read the replies already come; a connection the server closed is dropped here."""
        try:
            while self._owed > len(self._early) and self._conn.can_read(timeout=0):
                self._early.append(self._one())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self.drop()
