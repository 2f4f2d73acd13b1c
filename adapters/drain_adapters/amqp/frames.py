"""The frames of ``basic.publish`` as AMQP 0-9-1 lays them out, built in Python for a whole batch
at once. Pure functions, no I/O, no client library.

A published message is a method frame (``basic.publish``: the exchange, the routing key, the
``mandatory`` and ``immediate`` bits), a content header frame (the body's size and the encoded
properties) and the body in frames of at most ``frame_max`` bytes each (none for an empty
body). Each frame is a type octet, the channel (short), the payload size (long), the payload and
the frame-end octet ``0xCE``: 8 bytes around the payload, so a body frame carries at most
``frame_max - 8`` bytes of the body. The layout is py-amqp's ``frame_writer``'s byte for byte
(tests/unit/test_amqp_frames.py decodes both), only without one system call per message: a
batch's frames are gathered (``PublishFrames``) and written in as few socket calls as
``WRITE_CHUNK_BYTES`` allows, each call a whole number of messages (``Chunk``): a writer that
stops between two chunks has written whole messages only, and knows which. The method frame
depends only on the exchange and the routing key, so it is built once per queue of a batch.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import NamedTuple

METHOD, HEADER, BODY = 1, 2, 3  # frame types
FRAME_END = b"\xce"
FRAME_OVERHEAD_BYTES = 8  # type (1), channel (2), size (4) and the frame-end octet (1)
BASIC_CLASS = 60
BASIC_PUBLISH = 40
WRITE_CHUNK_BYTES = 1 << 20
"""A batch is joined into writes of at most this size (or one message, when larger): a few system
calls for a large batch, and never a second copy of a whole batch's bodies in memory."""

_FRAME_HEAD = struct.Struct(">BHI")
_HEADER_HEAD = struct.Struct(">BHIHHQ")  # a header frame's head: frame head, class, weight, body size
_PUBLISH_HEAD = struct.Struct(">BHIHHH")  # frame head, class, method, reserved short
_HEADER_FIXED_BYTES = 2 + 2 + 8


def short_string(text: str, what: str) -> bytes:
    """``text`` as an AMQP short string (a length octet, then UTF-8, as py-amqp encodes it);
    raise ValueError over 255 bytes."""
    encoded = text.encode("utf-8", "surrogatepass")
    if len(encoded) > 255:
        raise ValueError(f"{what} is {len(encoded)} bytes in UTF-8; AMQP allows 255")
    return bytes((len(encoded),)) + encoded


def method_frame(
    channel: int, exchange: str, routing_key: str, *, mandatory: bool, immediate: bool = False
) -> bytes:
    """The ``basic.publish`` method frame."""
    arguments = (
        short_string(exchange, "the exchange")
        + short_string(routing_key, "the routing key")
        + bytes((int(mandatory) | int(immediate) << 1,))
    )
    head = _PUBLISH_HEAD.pack(METHOD, channel, 6 + len(arguments), BASIC_CLASS, BASIC_PUBLISH, 0)
    return head + arguments + FRAME_END


def content_frames(
    channel: int, properties: bytes, body: bytes | memoryview, frame_max: int
) -> Iterator[bytes | memoryview]:
    """The content header frame (``properties``: the property flags and list, encoded) and the
    body frames, as pieces to be joined. Raise ValueError when the header frame exceeds
    ``frame_max`` (the broker would close the connection) or ``frame_max`` leaves no room for a
    body byte."""
    size = len(body)
    header_payload = _HEADER_FIXED_BYTES + len(properties)
    if header_payload + FRAME_OVERHEAD_BYTES > frame_max:
        taken = header_payload + FRAME_OVERHEAD_BYTES
        raise ValueError(f"the content header frame takes {taken} bytes, over frame_max {frame_max}")
    yield _HEADER_HEAD.pack(HEADER, channel, header_payload, BASIC_CLASS, 0, size)
    yield properties
    yield FRAME_END
    chunk = frame_max - FRAME_OVERHEAD_BYTES
    if chunk <= 0:
        raise ValueError(f"frame_max {frame_max} leaves no room for a body")
    if size <= chunk:
        if size:
            yield _FRAME_HEAD.pack(BODY, channel, size)
            yield body
            yield FRAME_END
        return
    view = memoryview(body)
    for start in range(0, size, chunk):
        piece = view[start : start + chunk]
        yield _FRAME_HEAD.pack(BODY, channel, len(piece))
        yield piece
        yield FRAME_END


class Chunk(NamedTuple):
    """One socket write: the frames of ``messages`` whole messages, the next of the batch's."""

    data: bytes
    messages: int


class PublishFrames:
    """A batch's ``basic.publish`` frames on one channel, gathered to be written together.

    ``add`` builds one message's frames (the method frame once per exchange and routing key);
    ``writes`` yields them joined into chunks of whole messages, at most ``WRITE_CHUNK_BYTES``
    each (or one message). A message whose frames cannot be built raises from ``add`` and leaves
    nothing of itself behind."""

    def __init__(self, channel: int, frame_max: int) -> None:
        self.channel = channel
        self.frame_max = frame_max
        self.count = 0
        self._pieces: list[bytes | memoryview] = []
        self._ends: list[tuple[int, int]] = []  # each message: (its pieces' end, its bytes)
        self._methods: dict[tuple[str, str, bool], bytes] = {}

    def add(
        self, exchange: str, routing_key: str, properties: bytes, body: bytes, *, mandatory: bool
    ) -> None:
        key = (exchange, routing_key, mandatory)
        method = self._methods.get(key)
        if method is None:
            method = self._methods[key] = method_frame(
                self.channel, exchange, routing_key, mandatory=mandatory
            )
        content = list(content_frames(self.channel, properties, body, self.frame_max))
        self._pieces.append(method)
        self._pieces.extend(content)
        self._ends.append((len(self._pieces), len(method) + sum(len(piece) for piece in content)))
        self.count += 1

    def writes(self, chunk_bytes: int = WRITE_CHUNK_BYTES) -> Iterator[Chunk]:
        """The gathered frames, in order, joined into chunks of whole messages: a chunk takes the
        next message while it stays within ``chunk_bytes``; a message larger than that is a
        chunk of its own."""
        start = first = size = 0
        for index, (_end, message_bytes) in enumerate(self._ends):
            if size and size + message_bytes > chunk_bytes:
                stop = self._ends[index - 1][0]
                yield Chunk(b"".join(self._pieces[start:stop]), index - first)
                start, first, size = stop, index, 0
            size += message_bytes
        if first < len(self._ends):
            yield Chunk(b"".join(self._pieces[start:]), len(self._ends) - first)

    def __bool__(self) -> bool:
        return bool(self._pieces)
