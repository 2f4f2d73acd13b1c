"""The NATS protocol reader (drain_adapters.nats.protocol.Connection) over a socket pair: replies
are found whatever the chunks the bytes arrive in, PINGs are answered, a permissions violation is
kept while any other -ERR or a line the protocol does not have ends the connection."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from drain_adapters.nats import protocol
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.fixture
def pair() -> Iterator[tuple[protocol.Connection, socket.socket]]:
    ours, theirs = socket.socketpair()
    connection = protocol.Connection(ours, {}, b"_INBOX.abc")
    yield connection, theirs
    connection.close()
    theirs.close()


def drain_all(connection: protocol.Connection) -> list[protocol.Reply]:
    got: list[protocol.Reply] = []
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:
        connection.read(time.monotonic() + 0.02, got.append)
    return got


def wire(replies: list[tuple[int, int | None, bytes]]) -> bytes:
    out = b""
    for token, status, payload in replies:
        if status is None:  # one space between fields (a PubAck's usual line), or more
            spaces = b" " * (1 + token % 2)
            out += b"MSG _INBOX.abc.%d 1%s%d\r\n%s\r\n" % (token, spaces, len(payload), payload)
        else:
            headers = b"NATS/1.0 %d\r\n\r\n" % status
            total = len(headers) + len(payload)
            out += b"HMSG _INBOX.abc.%d 1 %d %d\r\n%s%s\r\n" % (token, len(headers), total, headers, payload)
        out += b"PING\r\n+OK\r\n" if token % 3 == 0 else b""
    return out


@settings(max_examples=50, deadline=None)
@given(
    replies=st.lists(
        st.tuples(st.integers(1, 10**6), st.none() | st.sampled_from([503, 408]), st.binary(max_size=40)),
        max_size=20,
    ),
    cuts=st.lists(st.integers(1, 30), max_size=40),
)
def test_replies_are_found_whatever_the_chunks(
    replies: list[tuple[int, int | None, bytes]], cuts: list[int]
) -> None:
    ours, theirs = socket.socketpair()
    connection = protocol.Connection(ours, {}, b"_INBOX.abc")
    try:
        data = wire(replies)
        got: list[protocol.Reply] = []
        position = 0
        for cut in [*cuts, len(data)]:
            piece = data[position : position + cut]
            position += len(piece)
            if piece:
                theirs.sendall(piece)
                connection.read(time.monotonic() + 1.0, got.append)
        while len(got) < len(replies):
            connection.read(time.monotonic() + 1.0, got.append)
        assert [(r.token, r.status, r.payload) for r in got] == replies
        pongs = sum(1 for token, _, _ in replies if token % 3 == 0)
        if pongs:
            theirs.settimeout(1.0)
            assert theirs.recv(1000).count(b"PONG\r\n") >= 1
    finally:
        connection.close()
        theirs.close()


def test_a_denied_publish_is_kept_by_its_subject_and_the_connection_stays(
    pair: tuple[protocol.Connection, socket.socket],
) -> None:
    connection, theirs = pair
    theirs.sendall(b"-ERR 'Permissions Violation for Publish to \"jobs.x\"'\r\n")
    drain_all(connection)
    assert connection.denied == ["jobs.x"] and connection.refusal is None
    assert not connection.closed


def test_another_permissions_violation_is_kept_as_the_connections_refusal(
    pair: tuple[protocol.Connection, socket.socket],
) -> None:
    connection, theirs = pair
    theirs.sendall(b"-ERR 'Permissions Violation for Subscription to \"_INBOX.x.*\"'\r\n")
    drain_all(connection)
    assert connection.refusal is not None and "_INBOX.x" in connection.refusal
    assert connection.denied == [] and not connection.closed


@pytest.mark.parametrize(
    "line",
    [b"-ERR 'Authorization Violation'\r\n", b"MSG _INBOX.abc.1 1 notanumber\r\n", b"INFO {not json\r\n"],
)
def test_any_other_error_or_a_line_the_protocol_lacks_ends_the_connection(
    pair: tuple[protocol.Connection, socket.socket], line: bytes
) -> None:
    connection, theirs = pair
    theirs.sendall(line)
    with pytest.raises(protocol.LinkDown):
        drain_all(connection)
    assert connection.closed


def test_the_server_closing_is_link_down(pair: tuple[protocol.Connection, socket.socket]) -> None:
    connection, theirs = pair
    theirs.close()
    with pytest.raises(protocol.LinkDown, match="closed"):
        drain_all(connection)
