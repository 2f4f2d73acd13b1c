"""pika's select-based I/O, as the RabbitMQ link drives it: through pika's public interfaces only
(a custom I/O loop and I/O services, ``pika.adapters.utils``), never its private attributes.

- ``WatchingIOLoop`` remembers which descriptors pika asks it to watch: the socket, which
  ``shut_down`` ends without the closing handshake when the link drops a connection.
- ``HoldingIOServices`` gives pika a stream transport that can hold writes (``HoldingTransport``):
  pika writes every frame as its own chunk (a message is three frames: method, header, body) and
  sends each with its own ``send()``; with TCP_NODELAY that is a system call and a TCP segment
  per frame, which on a small machine cost more CPU than the rest of publishing. A batch's frames
  are held while it is written and handed to pika's transport as one chunk, so the batch leaves
  in a few large sends (tests/integration/test_rabbitmq_sends.py). Same bytes, same order.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
from collections.abc import Callable
from typing import Any

import pika.adapters.select_connection
from pika.adapters.utils import nbio_interface, selector_ioloop_adapter


class WatchingIOLoop(pika.adapters.select_connection.IOLoop):  # type: ignore[misc]
    """pika's select-based I/O loop, remembering which descriptors it watches (the socket)."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: set[int] = set()

    def add_handler(self, fd: int, handler: Callable[[int, int], None], events: int) -> None:
        super().add_handler(fd, handler, events)
        self.watched.add(fd)

    def remove_handler(self, fd: int) -> None:
        self.watched.discard(fd)
        super().remove_handler(fd)


class HoldingTransport(nbio_interface.AbstractStreamTransport):  # type: ignore[misc]
    """A stream transport that passes writes on to pika's, or holds them between ``hold`` and
    ``release`` and then passes them on joined."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._held: list[bytes] | None = None

    def hold(self) -> None:
        if self._held is None:
            self._held = []

    def release(self) -> None:
        held, self._held = self._held, None
        if held:
            self._inner.write(b"".join(held))

    def abort(self) -> None:
        self._held = None
        self._inner.abort()

    def get_protocol(self) -> Any:
        return self._inner.get_protocol()

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._inner.write(data)
        else:
            self._held.append(data)

    def get_write_buffer_size(self) -> int:
        held = sum(len(chunk) for chunk in self._held or ())
        return int(self._inner.get_write_buffer_size()) + held


class _Protocol(nbio_interface.AbstractStreamProtocol):  # type: ignore[misc]
    """pika's protocol (its connection), introduced to a HoldingTransport instead of pika's own."""

    def __init__(self, inner: Any, services: HoldingIOServices) -> None:
        self.inner = inner
        self._services = services

    def connection_made(self, transport: Any) -> None:
        self._services.transport = HoldingTransport(transport)
        self.inner.connection_made(self._services.transport)

    def connection_lost(self, error: BaseException | None) -> None:
        self.inner.connection_lost(error)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[no-any-return]

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)


class HoldingIOServices(selector_ioloop_adapter.SelectorIOServicesAdapter):  # type: ignore[misc]
    """pika's I/O services over ``loop`` whose stream connection is a HoldingTransport
    (``transport``, once connected). Pass it to ``pika.SelectConnection`` as ``custom_ioloop``."""

    def __init__(self, loop: WatchingIOLoop) -> None:
        super().__init__(loop)
        self.transport: HoldingTransport | None = None

    def create_streaming_connection(
        self,
        protocol_factory: Callable[[], Any],
        sock: socket.socket,
        on_done: Callable[[Any], None],
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> Any:
        def wrapped_factory() -> _Protocol:
            return _Protocol(protocol_factory(), self)

        def linked(result: Any) -> None:
            if isinstance(result, BaseException) or self.transport is None:
                on_done(result)
            else:  # pika's connection workflow takes back its own protocol, on our transport
                on_done((self.transport, result[1].inner))

        return super().create_streaming_connection(
            wrapped_factory, sock, linked, ssl_context=ssl_context, server_hostname=server_hostname
        )


class DrivenLoop:
    """One pika I/O loop run by hand on the caller's thread (no background thread), with the
    I/O services to give ``pika.SelectConnection`` as ``custom_ioloop``. Heartbeats are serviced
    only while it runs."""

    def __init__(self) -> None:
        self.loop = WatchingIOLoop()
        self.services = HoldingIOServices(self.loop)
        self._predicate: Callable[[], bool] | None = None  # while running

    def run_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Run the loop until ``predicate()`` holds (see ``wake``) or ``timeout_s`` passed (0: one
        pass)."""
        if predicate():
            return
        loop = self.loop
        self._predicate = predicate
        timer = loop.call_later(timeout_s, loop.stop)
        try:
            loop.start()
        finally:
            self._predicate = None
            loop.remove_timeout(timer)

    def wake(self) -> None:
        """Called from pika's callbacks: stop the loop once the predicate it runs for holds."""
        if self._predicate is not None and self._predicate():
            self.loop.stop()

    def hold(self) -> None:
        """Hold what pika writes from now on (see the module docstring)."""
        if self.services.transport is not None:
            self.services.transport.hold()

    def hand_over(self) -> None:
        """Pass what was held to pika's transport, joined; it leaves at the next run."""
        if self.services.transport is not None:
            self.services.transport.release()

    def shut_down(self, is_closed: Callable[[], bool], timeout_s: float) -> None:
        """End the connection without the closing handshake: shut its socket down and run the
        loop until pika noticed (``is_closed``) or ``timeout_s`` passed; then close the loop."""
        if not is_closed():
            for fd in list(self.loop.watched):
                shut_down(fd)
            self.run_until(is_closed, timeout_s)
        self.loop.close()


def shut_down(fd: int) -> None:
    """Shut down the socket behind ``fd`` (both directions) without closing pika's descriptor:
    its owner sees end-of-stream and closes it itself."""
    with contextlib.suppress(OSError):
        duplicate = socket.socket(fileno=os.dup(fd))
        try:
            duplicate.shutdown(socket.SHUT_RDWR)
        finally:
            duplicate.close()
