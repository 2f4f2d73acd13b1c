"""Celery on AMQP's link (``amqp.link``) on py-amqp, kombu's client: one connection with one
channel in confirm mode, read only inside the link's waits (``drain_events``).

py-amqp's exceptions are translated here and nowhere else (``translated``; ``_write`` tells the
link's failure from the message's own): what a broken connection raises (the socket's errors and
py-amqp's recoverable ones) is LinkDown; a channel the broker closed (``ChannelError``) is
reported to the link's failure state, and py-amqp's revived channel (without confirm mode) is
never published on. Heartbeats are off (this client only reads inside a wait); a connection idle
longer than ``IDLE_RECONNECT_S`` is replaced before the next batch, so nothing is written on a
socket a broker restart left dead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import amqp
import amqp.exceptions

from drain.backend import deadline as call_deadline
from drain_adapters.amqp import confirms as amqp_confirms
from drain_adapters.amqp import frames as amqp_frames
from drain_adapters.amqp import link as amqp_link
from drain_adapters.amqp import names as amqp_names
from drain_adapters.celery import amqp_properties
from drain_adapters.celery import message as celery_message

log = logging.getLogger(__name__)

IDLE_RECONNECT_S = 30.0
CLOSE_TIMEOUT_S = 2.0
MIN_READ_S = 0.05  # the last read of confirms already in the socket (0 would not block at all)
CONFIRM_RESERVE_SHARE = 0.5
"""A batch's writes take at most the rest of what is left of the call when they begin: no chunk
is written once less than this share of it is left (on top of the chunk's estimated write). The
reserve is the time for the bytes still in the socket's buffers to reach the broker and for
their confirms to come back; the chunks not written retry with a later batch."""
# What a broken connection raises in py-amqp: the socket's errors and its own recoverable ones.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    EOFError,
    amqp.exceptions.RecoverableConnectionError,
    amqp.exceptions.ConnectionError,
)


@dataclasses.dataclass(frozen=True)
class AmqpAddress:
    """Where the broker is, parsed as kombu parses a Celery ``broker_url``."""

    host: str
    port: int
    userid: str
    password: str
    virtual_host: str
    ssl: bool

    @classmethod
    def parse_all(cls, url: str) -> tuple[AmqpAddress, ...]:
        """Each node of a ``;``-separated ``broker_url`` (kombu's failover spelling), in order."""
        return tuple(cls.parse(part.strip()) for part in url.split(";") if part.strip())

    @property
    def node(self) -> str:
        """``host:port``, safe to log."""
        return f"{self.host}:{self.port}"

    def connection_arguments(self) -> dict[str, Any]:
        """``amqp.Connection``'s arguments for this node."""
        return {
            "host": self.node,
            "userid": self.userid,
            "password": self.password,
            "virtual_host": self.virtual_host,
            "ssl": self.ssl,
        }

    @classmethod
    def parse(cls, url: str) -> AmqpAddress:
        """Raise ValueError for a URL that is not amqp://, amqps:// or pyamqp://."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("amqp", "amqps", "pyamqp"):
            raise ValueError("must be an amqp://, amqps:// or pyamqp:// URL")
        ssl = parts.scheme == "amqps"
        path = parts.path[1:] if parts.path.startswith("/") else parts.path
        return cls(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or (5671 if ssl else 5672),
            userid=urllib.parse.unquote(parts.username or "guest"),
            password=urllib.parse.unquote(parts.password or "guest"),
            virtual_host=urllib.parse.unquote(path) or "/",
            ssl=ssl,
        )


class FramedMessage(amqp.Message):  # type: ignore[misc]  # py-amqp is untyped
    """An ``amqp.Message`` whose properties (the headers table among them) are encoded once, when
    it is built, as py-amqp encodes them (``amqp_properties``): their size is then known before it
    is sent (the content header frame must fit the connection's ``frame_max``), and its content
    header frame carries these very bytes. Nothing changes the properties after it is built.
    (py-amqp has no public encoder of properties: this overrides the one method that encodes
    them, which is also ``amqp_properties``' fallback.)"""

    __slots__ = ("encoded_properties",)

    def __init__(self, body: bytes, **properties: Any) -> None:
        super().__init__(body, **properties)
        self.encoded_properties: bytes = amqp_properties.encode(
            self.properties, lambda: amqp.Message._serialize_properties(self)
        )

    def _serialize_properties(self) -> bytes:
        return self.encoded_properties

    @property
    def header_frame_bytes(self) -> int:
        """The size of the content header frame carrying these properties."""
        return amqp_names.HEADER_FRAME_OVERHEAD_BYTES + len(self.encoded_properties)


Wire = tuple[celery_message.CeleryMessage, FramedMessage]


class BoundedConnection(amqp.Connection):  # type: ignore[misc]  # py-amqp is untyped
    """py-amqp's connection whose every wait for a frame (the handshake's, a channel's reply, a
    confirm) is also bounded by what is left of the adapter's call: py-amqp gives each of the
    handshake's frames the whole connect timeout, and each frame of a message its own wait."""

    def __init__(self, deadline: call_deadline.Deadline, **arguments: Any) -> None:
        self.call_deadline = deadline
        super().__init__(**arguments)

    def blocking_read(self, timeout: float | None = None) -> Any:
        """Read one frame within ``timeout`` (None: the socket's own, e.g. a polite close's) or
        what is left of the call; past the deadline only a frame already come is read."""
        if timeout is None:
            sock = getattr(self._transport, "sock", None)
            timeout = sock.gettimeout() if sock is not None else None
        return super().blocking_read(self.call_deadline.read_bound(timeout))


class CeleryAmqpLink(amqp_link.AmqpLink[Wire]):
    """The connection and confirm-mode channel Celery messages are published on.

    ``on_unroutable(exchange, routing_key)``: whether a message the broker returned unroutable
    went to a queue the drain declared on this connection (deleted since): its job retries."""

    CLOSE_BEFORE_REOPEN = False  # an idle connection may be dead: write nothing on it
    NO_NODE = "no node within the connect timeout"
    TOO_LARGE_HEADERS = "the headers (task name, shadow, headers option) are too large"
    GONE_EXCHANGE_FAILS_ALL = False  # each queue has its exchange: one gone fails its jobs only

    def __init__(
        self,
        name: str,
        addresses: Sequence[AmqpAddress],
        *,
        publish_timeout_s: float,
        connect_timeout_s: float,
        on_unroutable: Callable[[str, str], bool],
    ) -> None:
        self.addresses = tuple(addresses)
        super().__init__(
            name,
            amqp_confirms.ConfirmTracker("celery"),  # by delivery tag; task id = job id
            [address.node for address in self.addresses],
            label="celery",
            what=f"celery backend {name} (amqp)",
            connect_timeout_s=connect_timeout_s,
            publish_timeout_s=publish_timeout_s,
            idle_limit_s=IDLE_RECONNECT_S,
        )
        self._on_unroutable = on_unroutable
        self._connection: amqp.Connection | None = None
        self._channel: Any = None
        self._frames: amqp_frames.PublishFrames | None = None  # the batch being written

    def describe(self, error: BaseException | str) -> str:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        for address in self.addresses:
            if address.password:
                text = text.replace(address.password, "***")
        return text

    @contextlib.contextmanager
    def translated(self) -> Iterator[None]:
        """py-amqp's connection errors as LinkDown (a channel closed by the broker is reported)."""
        try:
            yield
        except CONNECTION_ERRORS as exc:
            raise amqp_link.LinkDown(self.describe(exc)) from None
        except amqp.exceptions.ChannelError as exc:
            self._closed_by_broker(exc)

    @property
    def connection_open(self) -> bool:
        return self._connection is not None

    @property
    def ready(self) -> bool:
        return self._channel is not None and bool(self._channel.is_open)

    def new_channel(self) -> Any:
        """A channel of its own on the live connection (declarations go on one)."""
        assert self._connection is not None
        return self._connection.channel()

    def _connect(self, index: int, timeout_s: float) -> str | None:
        connection = BoundedConnection(
            self.deadline,
            **self.addresses[index].connection_arguments(),
            connect_timeout=self.deadline.read_bound(timeout_s),
            read_timeout=self.publish_timeout_s,
            write_timeout=self.publish_timeout_s,
            heartbeat=0,
            on_blocked=self._on_blocked,
            on_unblocked=self.unblocked_by_broker,
        )
        self._connection = connection  # released below when connecting fails
        try:
            connection.connect()
            self._open_channel()
        except Exception as exc:  # noqa: BLE001 - any failure to connect is the backend's
            self._release()
            return self.describe(exc)
        self.frame_max = int(connection.frame_max)  # as the broker tuned it on this connection
        return None

    def _open_channel(self) -> None:
        channel = self.new_channel()
        channel.confirm_select()
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        channel.events["basic_return"].add(self._on_return)
        self.tracker.restart()  # tags restart at 1
        self._channel = channel

    def _reopen_channel(self) -> None:
        try:
            with self.translated():
                self._open_channel()
        except amqp.exceptions.AMQPError as exc:
            raise amqp_link.LinkDown(self.describe(exc)) from None
        if not self.ready:
            raise amqp_link.LinkDown(self.channel_error or "no channel in confirm mode")

    def _closed_by_broker(self, exc: amqp.exceptions.ChannelError) -> None:
        """The broker closed the publishing channel; py-amqp revived it without confirm mode."""
        self._channel = None
        reason = f"{type(exc).__name__}: {exc.reply_text}"
        self.channel_closed(reason, exc.reply_code, str(exc.reply_text))

    def _read(self, timeout_s: float) -> bool:
        """Handle the next frame if one arrives within ``timeout_s``; say whether one did."""
        connection = self._connection
        if connection is None:
            raise amqp_link.LinkDown(self.failure or "not connected")
        with self.translated():
            try:
                connection.drain_events(timeout=timeout_s)
            except TimeoutError:  # socket.timeout: nothing arrived in time (not a broken connection)
                return False
        return True

    def _wait(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            remaining = deadline - time.monotonic()
            if not self._read(max(remaining, 0.0)) and remaining <= 0:
                return

    def _read_more(self) -> bool:
        return self._read(MIN_READ_S)

    def _write_probe(self) -> None:
        with self.translated():
            probe = amqp.Message(amqp_link.PROBE_BODY, delivery_mode=1)
            self._channel.basic_publish(probe, "", amqp_link.PROBE_ROUTING_KEY)
            self.tracker.probe_sent()

    def _measure(self, message: Wire) -> tuple[int, int]:
        return len(message[0].body), message[1].header_frame_bytes

    def _begin_batch(self) -> None:
        self._frames = None

    def _write(self, message: Wire) -> None:
        """Build the message's frames into the batch's (``amqp_frames``); ``_flush`` writes them.
        A message whose frames cannot be built raises here: its own fault, nothing of it kept."""
        task, built = message
        connection = self._connection
        if not self.ready or connection is None:
            raise amqp_link.LinkDown("no channel in confirm mode")
        frames = self._frames
        if frames is None:
            frames = self._frames = amqp_frames.PublishFrames(
                self._channel.channel_id, int(connection.frame_max)
            )
        frames.add(task.exchange, task.routing_key, built.encoded_properties, built.body, mandatory=True)

    def _flush(self) -> int | None:
        """Write the batch's frames in as few socket calls as ``amqp_frames`` joins them into
        (whole messages each); return how many messages were written.

        A chunk is written only while the time left of the call covers its write (estimated from
        the slowest write before it) and a reserve for the confirms (CONFIRM_RESERVE_SHARE of what
        was left when the writes began: the bytes a write returns on may still sit in the
        socket's buffers, the broker confirms them once they arrived): the chunks after it are
        not written, their messages retry with a later batch, no frame of them on the wire. A
        write cut short (a timeout, a broken connection) may leave a frame half sent: the
        connection can carry nothing more (LinkDown with ``batch_lost``). Nothing is read
        meanwhile: a channel the broker closes over one message (it ignores the rest of the
        batch) is read in ``collect``, where every job not confirmed retries."""
        frames, self._frames = self._frames, None
        connection = self._connection
        if not frames or connection is None:
            return None
        transport = connection.transport
        reserve_s: float | None = None
        written = 0
        seconds_a_byte = 0.0  # the slowest write of this batch so far (0: the buffers took it)
        try:
            for chunk in frames.writes():
                started = time.monotonic()
                left_s = self.deadline.bound(self.publish_timeout_s)
                if reserve_s is None and left_s is not None:
                    reserve_s = CONFIRM_RESERVE_SHARE * left_s
                if left_s is None or left_s < (reserve_s or 0.0) + seconds_a_byte * len(chunk.data):
                    return written
                with transport.having_timeout(left_s):
                    transport.write(chunk.data)
                written += chunk.messages
                seconds_a_byte = max(seconds_a_byte, (time.monotonic() - started) / len(chunk.data))
        except CONNECTION_ERRORS as exc:
            raise amqp_link.LinkDown(self.describe(exc), batch_lost=True) from None
        return written

    def _close_politely(self) -> None:
        connection = self._connection
        if connection is None:
            return
        try:
            with connection.transport.having_timeout(CLOSE_TIMEOUT_S):
                connection.close()
        except Exception as exc:  # noqa: BLE001 - closing a broken connection may fail
            self._debug("closing failed", exc)

    def _release(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = None
        if connection is None:
            return
        try:
            connection.collect()
        except Exception as exc:  # noqa: BLE001 - a broken connection is being thrown away
            self._debug("dropping the connection", exc)

    def _debug(self, what: str, exc: Exception) -> None:
        log.debug("backend %s: %s: %s", self.name, what, type(exc).__name__, extra={"backend": self.name})

    # --- py-amqp callbacks (run inside drain_events) --------------------------------------------

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self.tracker.confirmed(delivery_tag, multiple=multiple, acked=True)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        self.tracker.confirmed(delivery_tag, multiple=multiple, acked=False)

    def _on_return(self, exc: Any, exchange: str, routing_key: str, message: Any) -> None:
        gone = self._on_unroutable(exchange, routing_key)
        self.tracker.returned(
            str(message.properties.get("correlation_id")),
            f"unroutable: {getattr(exc, 'reply_code', '?')} {getattr(exc, 'reply_text', exc)} "
            f"(exchange {exchange!r}, routing key {routing_key!r}: no queue of that name)"
            + ("; declaring it again" if gone else ""),
            retry=True,  # no route: every job of that routing key meets it, the queue's fault
        )

    def _on_blocked(self, _reason: Any) -> None:
        self.blocked_by_broker()
