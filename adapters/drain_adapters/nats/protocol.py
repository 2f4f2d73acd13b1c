"""One NATS client connection, spoken directly on a socket, on the caller's thread.

Why not nats-py: it is asyncio, the drain is synchronous on one thread, and bridging the two
(a private loop on a thread of its own, a future per call) costs more per message than the
protocol itself: publishing a job is one ``HPUB`` line plus its bytes, its acknowledgement one
``MSG`` line plus a small JSON PubAck (bench/bench_nats.py measures both ways). The protocol is
text (https://docs.nats.io/reference/reference-protocols/nats-protocol)::

    server: INFO {...}                       client: CONNECT {...}  PING  SUB <inbox>.* 1  PING
    server: PONG  PONG                       (or -ERR '<reason>': refused)
    client: HPUB <subject> <inbox>.<n> <header bytes> <total bytes>  headers body
    server: MSG <inbox>.<n> 1 <bytes>  {"stream": ..., "seq": ...}   (JetStream's PubAck)
            HMSG <inbox>.<n> 1 ... NATS/1.0 503                      (no responders: no stream)
    server: PING -> client: PONG (answered whenever the connection is read)

Every reply to the inbox is handed back as a ``Reply`` (its token ``n``, the status of its header
line, its payload); matching replies to jobs is the adapter's. A server's ``-ERR`` is fatal to the
connection (the server closes it) except a permissions violation: one for a publish names its
subject, kept in ``denied`` (the message is dropped, no reply comes for it); any other is kept in
``refusal``.
No call waits beyond the deadline it is given. Errors are ``LinkDown`` with text safe to log.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from drain_adapters.nats import settings as nats_settings

READ_CHUNK = 256 * 1024
WRITE_CHUNK = 1024 * 1024
"""A batch's messages go to the socket in one write up to this size (500 jobs of ~600 B: one)."""
MAX_LINE_BYTES = 64 * 1024  # a control line longer than this is no NATS server speaking
INBOX_SID = b"1"
PUBLISH_DENIED = "permissions violation for publish to "  # then the subject, Go-quoted
PLAIN_REPLY = re.compile(rb"MSG [^ \r\n]*\.([0-9]+) [^ \r\n]+ ([0-9]+)\r\n")
"""The line of a reply without headers to an inbox token (a PubAck): its token and size."""


class LinkDown(Exception):
    """The connection cannot be used; the message is safe to log."""


class Reply(NamedTuple):
    """A message delivered to the inbox: ``token`` is the last token of its subject."""

    token: int
    status: int | None
    """The status of its NATS/1.0 header line (503: no responders), or None."""
    payload: bytes


class Connection:
    """A connected, logged-in NATS connection with its inbox subscribed."""

    def __init__(self, sock: socket.socket, info: dict[str, Any], inbox: bytes) -> None:
        self._sock = sock
        self.info = info
        self.inbox = inbox
        self._buffer = bytearray()
        self.pongs = 0
        self.refusal: str | None = None
        """A permissions violation the server reported (it keeps the connection open)."""
        self.denied: list[str] = []
        """The subjects of the publishes the server refused for permissions, since last cleared."""
        self.closed = False
        self.last_io = time.monotonic()

    @property
    def max_payload(self) -> int:
        return int(self.info.get("max_payload") or 1_048_576)

    @classmethod
    def connect(
        cls, server: nats_settings.Server, settings: nats_settings.NatsSettings, timeout_s: float
    ) -> Connection:
        """Connect to ``server``, log in, subscribe the inbox; LinkDown saying why not."""
        deadline = time.monotonic() + timeout_s
        try:
            sock = socket.create_connection((server.host, server.port), timeout=timeout_s)
        except OSError as exc:
            raise LinkDown(f"cannot connect to {server}: {settings.describe(exc)}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        inbox = f"{settings.inbox_prefix}.{os.urandom(11).hex()}".encode()
        connection = cls(sock, {}, inbox)
        try:
            connection.info = connection._read_info(deadline)
            if server.tls or settings.wants_tls or connection.info.get("tls_required"):
                sock.settimeout(max(0.001, deadline - time.monotonic()))  # the handshake's bound
                connection._sock = tls_socket(connection._sock, server.host, settings)
            login = credentials(settings, connection.info.get("nonce"))
            connect = {
                "verbose": False,
                "pedantic": False,
                "headers": True,
                "no_responders": True,
                "protocol": 1,
                "lang": "python",
                "version": "drain",
                "name": "drain",
                **login,
            }
            connection.send(
                b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n"
                b"SUB " + inbox + b".* " + INBOX_SID + b"\r\nPING\r\n",
                deadline,
            )
            while connection.pongs < 2:
                connection.read(deadline, lambda _reply: None)
                if connection.refusal:
                    raise LinkDown(f"{server} refused the inbox subscription: {connection.refusal}")
                if time.monotonic() >= deadline and connection.pongs < 2:
                    raise LinkDown(f"{server} did not answer the login within connect_timeout_s")
        except LinkDown:
            connection.close()
            raise
        except (OSError, ValueError) as exc:
            connection.close()
            raise LinkDown(f"{server}: {settings.describe(exc)}") from None
        return connection

    def _read_info(self, deadline: float) -> dict[str, Any]:
        while b"\r\n" not in self._buffer:
            if not self._receive(deadline):
                raise LinkDown("the server sent no INFO within connect_timeout_s")
        line, _, rest = bytes(self._buffer).partition(b"\r\n")
        self._buffer = bytearray(rest)
        if not line.startswith(b"INFO "):
            raise LinkDown("the server did not greet with INFO: not a NATS server?")
        info: dict[str, Any] = json.loads(line[5:])
        return info

    # --- writing --------------------------------------------------------------------------------

    def send(self, data: bytes | bytearray | memoryview, deadline: float) -> None:
        """Write ``data`` whole before ``deadline``; LinkDown otherwise."""
        if self.closed:
            raise LinkDown("the connection is closed")
        try:
            self._sock.settimeout(max(0.001, deadline - time.monotonic()))
            self._sock.sendall(data)
        except OSError as exc:
            self.close()
            raise LinkDown(f"writing failed: {type(exc).__name__}: {exc}") from None
        self.last_io = time.monotonic()

    # --- reading --------------------------------------------------------------------------------

    def read(self, deadline: float, deliver: Callable[[Reply], None]) -> None:
        """Wait until something arrives or ``deadline`` passes (0 wait once it has), answer
        PINGs, and hand each inbox message to ``deliver``. LinkDown when the connection ends
        or the server sends what the protocol does not have."""
        self._receive(deadline)
        try:
            self._parse(deliver)
        except (ValueError, IndexError) as exc:
            self.close()
            raise LinkDown(
                f"the server sent what the NATS protocol does not have ({type(exc).__name__})"
            ) from None

    def poll(self, deliver: Callable[[Reply], None]) -> None:
        """``read`` without waiting: what has arrived already."""
        self.read(0.0, deliver)

    def _receive(self, deadline: float) -> bool:
        if self.closed:
            raise LinkDown("the connection is closed")
        try:
            self._sock.settimeout(max(0.0, deadline - time.monotonic()))
            chunk = self._sock.recv(READ_CHUNK)
        except (TimeoutError, BlockingIOError, ssl.SSLWantReadError):
            return False
        except OSError as exc:
            self.close()
            raise LinkDown(f"reading failed: {type(exc).__name__}: {exc}") from None
        if not chunk:
            self.close()
            raise LinkDown("the server closed the connection")
        self._buffer += chunk
        self.last_io = time.monotonic()
        return True

    def _parse(self, deliver: Callable[[Reply], None]) -> None:
        buffer = self._buffer
        position = 0
        try:
            while True:
                plain = PLAIN_REPLY.match(buffer, position)  # most replies: read in one call
                if plain is not None:
                    start = plain.end()
                    stop = start + int(plain[2])
                    if len(buffer) < stop + 2:
                        break
                    deliver(Reply(int(plain[1]), None, bytes(buffer[start:stop])))
                    position = stop + 2
                    continue
                end = buffer.find(b"\r\n", position)
                if end < 0:
                    if len(buffer) - position > MAX_LINE_BYTES:
                        raise LinkDown("the server sent a line too long for the NATS protocol")
                    break
                headed = buffer.startswith(b"HMSG", position)  # servers write their verbs in capitals
                if headed or buffer.startswith(b"MSG ", position):
                    parts = bytes(buffer[position:end]).split()
                    total = int(parts[-1])
                    stop = end + 2 + total
                    if len(buffer) < stop + 2:
                        break
                    header_bytes = int(parts[-2]) if headed else 0
                    status = (
                        status_of(bytes(buffer[end + 2 : end + 2 + header_bytes])) if header_bytes else None
                    )
                    payload = bytes(buffer[end + 2 + header_bytes : stop])
                    position = stop + 2
                    token = parts[1].rpartition(b".")[2]
                    if token.isdigit():
                        deliver(Reply(int(token), status, payload))
                    continue
                line = bytes(buffer[position:end])
                position = end + 2
                self._control(line)
        finally:
            del buffer[:position]

    def _control(self, line: bytes) -> None:
        word = line.split(b" ", 1)[0].upper()
        if word == b"PING":
            self.send(b"PONG\r\n", time.monotonic() + 1.0)
        elif word == b"PONG":
            self.pongs += 1
        elif word == b"INFO":
            self.info.update(json.loads(line[5:]))
        elif word == b"-ERR":
            reason = line[4:].strip().strip(b"'").decode(errors="replace")
            subject = reason[len(PUBLISH_DENIED) :]
            if reason.lower().startswith(PUBLISH_DENIED) and len(subject) > 2 and subject[0] == '"':
                self.denied.append(subject[1:-1])  # the server keeps the connection open
                return
            reason = reason[:300]
            if reason.lower().startswith("permissions violation"):
                self.refusal = reason  # the server keeps the connection open
                return
            self.close()
            raise LinkDown(f"the server closed the connection: {reason}")

    def close(self) -> None:
        """Release the socket (NATS has no closing handshake). Idempotent."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.close()


def status_of(headers: bytes) -> int | None:
    """The status code of a ``NATS/1.0 503 ...`` header block, or None (none, or no headers)."""
    first = headers.split(b"\r\n", 1)[0].split()
    if len(first) >= 2 and first[1].isdigit():
        return int(first[1])
    return None


def tls_socket(sock: socket.socket, host: str, settings: nats_settings.NatsSettings) -> socket.socket:
    """``sock`` upgraded to TLS, verifying the server against ``tls_ca_file`` (or the system's CAs)."""
    context = ssl.create_default_context(cafile=settings.tls_ca_file)
    if settings.tls_cert_file and settings.tls_key_file:
        context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    try:
        return context.wrap_socket(sock, server_hostname=host)
    except (ssl.SSLError, OSError) as exc:
        sock.close()
        raise LinkDown(f"TLS with {host} failed: {type(exc).__name__}: {exc}") from None


def credentials(settings: nats_settings.NatsSettings, nonce: str | None) -> dict[str, str]:
    """The CONNECT fields that log in: user and password, a token, or an NKey's signature of
    the server's nonce (with the user JWT of a creds file)."""
    if settings.user:
        return {"user": settings.user, "pass": settings.password or ""}
    if settings.token:
        return {"auth_token": settings.token}
    if not (settings.nkey_seed_file or settings.creds_file):
        return {}
    jwt, seed = read_key_files(settings)
    if not nonce:
        raise LinkDown("the server sent no nonce to sign with the NKey")
    import nkeys  # only for NKey logins (the nats extra)

    keys = nkeys.from_seed(seed)
    signature = base64.urlsafe_b64encode(keys.sign(nonce.encode())).rstrip(b"=").decode()
    fields = {"sig": signature}
    if jwt:
        fields["jwt"] = jwt
    else:
        fields["nkey"] = keys.public_key.decode()
    return fields


def read_key_files(settings: nats_settings.NatsSettings) -> tuple[str | None, bytes]:
    """(the user JWT or None, the NKey seed) from ``creds_file`` or ``nkey_seed_file``."""
    path = settings.creds_file or settings.nkey_seed_file
    assert path is not None
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise LinkDown(f"cannot read {path}: {exc.strerror}") from None
    blocks = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.strip().startswith(("-", "*", "#"))
    ]
    seed = next((block for block in blocks if block.startswith("SU")), None)
    jwt = next((block for block in blocks if block.startswith("ey")), None) if settings.creds_file else None
    if seed is None or (settings.creds_file and jwt is None):
        raise LinkDown(
            f"{path} holds no user NKey seed (SU...)" + (" and JWT" if settings.creds_file else "")
        )
    return jwt, seed.encode()
