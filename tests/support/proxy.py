"""A small threaded TCP proxy that can cut, reset or blackhole the path between two processes.

Modes (``Proxy.mode``):

- ``pass``: forward bytes both ways.
- ``cut``: close every connection cleanly (FIN) and close new ones at once.
- ``reset``: abort every connection with an RST (SO_LINGER 0) and reset new ones at once.
- ``blackhole``: stop forwarding but keep every socket open (new ones are accepted and held);
  switching back to ``pass`` resumes forwarding what the kernel buffered.

Through a userspace proxy the kernel on both sides still ACKs and answers keepalives, so a
blackhole here is a stalled middlebox, not a dead cable: the peers only notice through their
own application-level timeouts (or the server ending an idle-in-transaction session).

``DelayProxy`` is the slow link instead: it forwards everything, each of the server's replies
late by ``reply_delay_s`` (requests go at once), so every wait alone ends within its timeout.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import struct
import threading
import time

PASS, CUT, RESET, BLACKHOLE = "pass", "cut", "reset", "blackhole"
MODES = (PASS, CUT, RESET, BLACKHOLE)


def _abort(sock: socket.socket | None) -> None:
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


def _close(sock: socket.socket | None) -> None:
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class Proxy:
    """Listens on 127.0.0.1:``port`` (a free one) and forwards to ``target``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.mode = PASS
        self.connections = 0
        self._generation = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True, name=f"proxy:{self.port}")
        self._thread.start()

    def set(self, mode: str) -> None:
        """Switch mode; cut/reset act on the existing connections within a tenth of a second."""
        assert mode in MODES, mode
        self.mode = mode
        self._generation += 1

    def close(self) -> None:
        self._closed.set()
        self.set(RESET)
        _close(self._listener)
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            if self.mode == RESET:
                _abort(client)
            elif self.mode == CUT:
                _close(client)
            else:
                threading.Thread(target=self._pump, args=(client,), daemon=True).start()

    def _pump(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            while not self._closed.is_set():
                mode = self.mode
                if mode in (RESET, CUT):
                    (_abort if mode == RESET else _close)(client)
                    (_abort if mode == RESET else _close)(upstream)
                    return
                if mode == BLACKHOLE:
                    self._closed.wait(0.05)
                    continue
                if upstream is None:
                    try:
                        upstream = socket.create_connection(self.target, timeout=5)
                    except OSError:
                        _abort(client)
                        return
                    upstream.settimeout(None)
                readable, _, _ = select.select([client, upstream], [], [], 0.1)
                for source in readable:
                    target = upstream if source is client else client
                    data = source.recv(65536)
                    if not data:
                        _close(client)
                        _close(upstream)
                        return
                    target.sendall(data)
        except OSError:
            _abort(client)
            _abort(upstream)


class DelayProxy:
    """Listens on 127.0.0.1:``port`` and forwards to ``target``, each chunk of the server's
    replies handed to the client ``reply_delay_s`` after it came (order kept; requests go at
    once): a slow link that answers everything, late. Set ``reply_delay_s`` to 0 to heal it
    (what is already queued still arrives on its own schedule)."""

    def __init__(self, target_host: str, target_port: int, reply_delay_s: float) -> None:
        self.target = (target_host, target_port)
        self.reply_delay_s = reply_delay_s
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True, name=f"delay:{self.port}")
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        _close(self._listener)
        for sock in list(self._sockets):
            _abort(sock)
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _abort(client)
                continue
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            for source, target, delayed in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(source, target, delayed), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, delayed: bool) -> None:
        chunks: collections.deque[tuple[float, bytes]] = collections.deque()
        arrived = threading.Condition()
        if delayed:
            threading.Thread(target=self._deliver, args=(chunks, arrived, target), daemon=True).start()
        try:
            while data := source.recv(65536):
                if not delayed:
                    target.sendall(data)
                    continue
                with arrived:
                    chunks.append((time.monotonic() + self.reply_delay_s, data))
                    arrived.notify()
        except OSError:
            pass
        if delayed:
            with arrived:
                chunks.append((0.0, b""))
                arrived.notify()
        else:
            _close(target)

    def _deliver(
        self,
        chunks: collections.deque[tuple[float, bytes]],
        arrived: threading.Condition,
        target: socket.socket,
    ) -> None:
        while True:
            with arrived:
                arrived.wait_for(lambda: bool(chunks))
                due, data = chunks.popleft()
            if not data:
                _close(target)
                return
            while (wait := due - time.monotonic()) > 0 and not self._closed.is_set():
                time.sleep(min(wait, 0.05))
            try:
                target.sendall(data)
            except OSError:
                return
