"""One connection to an AMQP broker with one channel in confirm mode, whatever the client library:
the lifecycle and the failure state the RabbitMQ backend (pika, ``rabbitmq.link``) and Celery on
AMQP (py-amqp, ``celery.amqp_link``) share. No client library is imported here.

The life of a link::

    open        connect to the first node that answers (the nodes share connect_timeout_s, see
                ``amqp.nodes``), a channel in confirm mode, then ``prove`` the broker takes a
                publish: one tiny probe, not mandatory, to the default exchange with a routing
                key no queue can have (``amq.`` names are the broker's), confirmed within what is
                left of the connect timeout (PROBE_MIN_S at least)
    ensure_ready (before each batch, each ping) read what the broker sent meanwhile (a
                ``connection.blocked``, a channel close); open again after a failure, an alarm
                or an idle period; reopen a channel the broker closed
    send        write a batch's messages (mandatory) and return; ``collect`` waits for a ticket's
                confirms until its deadline (what already arrived counts past it)
    drop        give up the connection at once, without the closing handshake (a blocked or
                hung broker would never answer it): unconfirmed jobs stay unconfirmed
    close       the polite close (bounded), then ``drop``

The failure state is here and nowhere else: ``failure`` (why the connection cannot be used: the
first reason recorded stays, ``fail``), ``blocked`` (a memory or disk alarm), ``channel_error``
(the broker closed the publishing channel; the connection lives) and ``broker_max_bytes`` (the
broker's max_message_size, once it refused a message over it on this connection). A library link
translates its client's exceptions at one boundary: what makes the connection or channel
unusable becomes ``LinkDown`` (its text without URL or password), which this class turns into
failure state; anything else a write raises is that message's own fault (its rejection). A
connection given up because it failed (or was blocked) sends the next ``open`` to the next node.

Why a probe: a broker under a memory or disk alarm stops reading a connection at its first
publish and answers ``connection.blocked``. Only the probe is held (and dropped as unroutable once
the alarm clears), never a batch, so retrying through an alarm does not pile up copies of the
batch in the broker's buffers. A probe the broker answers by closing the channel (a user without
write access to the default exchange) was read too: it proves the same.
"""

from __future__ import annotations

import abc
import collections
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

from drain import backend, errors, models
from drain.backend import deadline as call_deadline
from drain_adapters.amqp import confirms as amqp_confirms
from drain_adapters.amqp import frames as amqp_frames
from drain_adapters.amqp import nodes as amqp_nodes

log = logging.getLogger(__name__)

BLOCKED = "the broker blocks publishing (resource alarm)"
PRECONDITION_FAILED = 406
NOT_FOUND = 404
ACCESS_REFUSED = 403  # a permission of the drain's user: the backend's, whatever the message
PROBE_ROUTING_KEY = "amq.drain.probe"  # on the default exchange: "amq." queue names are reserved
PROBE_BODY = b"drain probe"  # not empty: a blocked broker stops between its header and body
PROBE_MIN_S = 1.0  # the probe's wait when connecting took (nearly) all of the connect timeout
NOT_WRITTEN = "not sent: too little of the publish timeout was left to write it and read its confirm"

M = TypeVar("M")  # what the library link writes for one job


class LinkDown(Exception):
    """The channel or connection cannot carry anything more (a library link's translation of its
    client's exception; the text holds no URL or password). ``channel_only``: the broker closed
    the channel and the connection lives. ``batch_lost`` (from ``_flush``): a write was cut short
    (a frame may be half sent), the connection can carry nothing more; only confirms the broker
    sent already can come."""

    def __init__(self, reason: str, *, channel_only: bool = False, batch_lost: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.channel_only = channel_only
        self.batch_lost = batch_lost


class LinkState(abc.ABC):
    """The failure state of one link (see the module docstring).

    ``label`` starts the reasons of jobs (``rabbitmq``, ``celery``); ``what`` starts the text of
    BackendUnavailable (``rabbitmq backend events``); ``node_names`` are the nodes as
    ``host:port``, safe to log."""

    GONE_EXCHANGE_FAILS_ALL = True
    """A channel closed 404 (an exchange is gone) fails every job alike: the backend is unavailable."""

    def __init__(
        self,
        name: str,
        tracker: amqp_confirms.ConfirmTracker,
        node_names: Sequence[str],
        *,
        label: str,
        what: str,
        connect_timeout_s: float,
        publish_timeout_s: float,
        idle_limit_s: float,
    ) -> None:
        self.name = name
        self.tracker = tracker
        self.node_names = tuple(node_names)
        self.nodes = amqp_nodes.NodeRotation(len(self.node_names))
        self.label = label
        self.what = what
        self.connect_timeout_s = connect_timeout_s
        self.publish_timeout_s = publish_timeout_s
        self.deadline = call_deadline.Deadline(publish_timeout_s)
        """The adapter's call under way (``drain.backend.deadline``): ``open`` and the batch after
        it share one; a ticket's confirms are awaited until its own."""
        self.idle_limit_s = idle_limit_s
        self.failure: str | None = None
        self.blocked = False
        self.channel_error: str | None = None
        self.broker_max_bytes: int | None = None
        self.frame_max = 131_072  # the negotiated value once open
        self.generation = 0
        """Counts the connections made: what was declared on one is not on the next."""
        self._node: int | None = None  # the node last connected to
        self._last_io = 0.0

    @abc.abstractmethod
    def describe(self, error: BaseException | str) -> str:
        """``error`` as one line of text with every URL and password masked."""

    @property
    @abc.abstractmethod
    def connection_open(self) -> bool:
        """A connection is open (it may have failed or be blocked all the same)."""

    def fail(self, error: BaseException | str) -> str:
        """Record why the connection cannot be used (the first reason recorded stays); return it."""
        if self.failure is None:
            self.failure = self.describe(error)
        return self.failure

    @property
    def usable(self) -> bool:
        """The connection is open, not failed and not blocked (the channel may need reopening)."""
        return self.connection_open and self.failure is None and not self.blocked

    def unavailable(self, reason: BaseException | str) -> errors.BackendUnavailable:
        text = f"{self.what}: {self.describe(reason)}"
        return errors.BackendUnavailable(text[: backend.MAX_REASON_CHARS])

    def blocked_by_broker(self) -> None:
        """The broker sent ``connection.blocked`` (a memory or disk alarm)."""
        log.warning(
            "backend %s: the broker blocks publishing (memory or disk alarm)",
            self.name,
            extra={"event": "broker_blocked", "backend": self.name},
        )
        self.blocked = True

    def unblocked_by_broker(self) -> None:
        self.blocked = False

    def channel_closed(self, reason: str, reply_code: int | None = None, reply_text: str = "") -> None:
        """The broker (``reply_code``) or the client closed the publishing channel; the connection
        lives. The jobs it carried retry, but for one over the broker's max_message_size: that one
        is refused (an attempt counted), and the limit kept for this connection so the next
        oversized message is refused before it is sent."""
        self.channel_error = reason
        if reply_code is None:
            return
        limit = amqp_confirms.oversize_limit(reply_text)
        if reply_code == PRECONDITION_FAILED and limit is not None:
            self.broker_max_bytes = limit
            self.tracker.refuse_larger(limit, f"refused by the broker: {reply_text}")
        else:
            gone = reply_code == NOT_FOUND and self.GONE_EXCHANGE_FAILS_ALL
            self.tracker.abandon(f"channel closed: {reason}", retry=not gone and reply_code != ACCESS_REFUSED)


class ClientBoundary(LinkState, Generic[M]):
    """What each client library provides: a link translates its client's exceptions here, at one
    boundary (``LinkDown``), and reports what the broker sends through ``LinkState``."""

    @property
    @abc.abstractmethod
    def ready(self) -> bool:
        """A channel in confirm mode is open: a message may be written."""

    @abc.abstractmethod
    def _connect(self, index: int, timeout_s: float) -> str | None:
        """Connect to node ``index`` and open a channel in confirm mode within ``timeout_s``;
        None, or why not (nothing left open then)."""

    @abc.abstractmethod
    def _reopen_channel(self) -> None:
        """Open a new channel in confirm mode on the live connection; raise LinkDown."""

    @abc.abstractmethod
    def _wait(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Handle what the broker sends until ``predicate()`` holds or ``timeout_s`` passed (0:
        what already arrived); raise LinkDown."""

    @abc.abstractmethod
    def _read_more(self) -> bool:
        """Handle what already arrived, without waiting (or hardly); say whether it settled
        something. Raise LinkDown."""

    @abc.abstractmethod
    def _write_probe(self) -> None:
        """Write the probe on the publishing channel (``tracker.probe_sent``); raise LinkDown."""

    @abc.abstractmethod
    def _measure(self, message: M) -> tuple[int, int]:
        """(the body's bytes, the content header frame's bytes) of one message."""

    @abc.abstractmethod
    def _write(self, message: M) -> None:
        """Write one message (mandatory) on the publishing channel; raise LinkDown when the
        channel or connection cannot carry it, anything else for the message's own fault."""

    def _begin_batch(self) -> None:
        """Before a batch's writes (a library may hold them to send them together)."""

    def _flush(self) -> int | None:
        """After a batch's writes: hand them to the socket; return how many of the messages
        ``_write`` took were written (the first ones, in order; None: all). The others never
        reached the socket: their jobs retry, their delivery tags unused. Raise LinkDown."""
        return None

    @abc.abstractmethod
    def _close_politely(self) -> None:
        """Close the connection with the closing handshake, bounded (errors are logged)."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Forget the connection at once, without the closing handshake. Never raises."""

    def _prepare(self) -> None:
        """After connecting, before the probe (declaring a topology); raise BackendUnavailable."""

    def _after_ready(self) -> None:
        """At the end of ``ensure_ready`` (declaring again what was found gone)."""


class Lifecycle(ClientBoundary[M]):
    """Open, keep ready, prove, close and drop the connection (see the module docstring)."""

    CLOSE_BEFORE_REOPEN = True
    """Close a usable connection politely before opening a new one (else drop it)."""
    NO_NODE = "no node within connect_timeout_s"

    @property
    def clustered(self) -> bool:
        return self.nodes.count > 1

    def open(self) -> None:
        """Connect to the first node that answers, open a channel in confirm mode, prepare and
        prove the broker takes a publish; raise BackendUnavailable (nothing left open) when that
        fails."""
        if self.usable and self.CLOSE_BEFORE_REOPEN:
            self.close()
        else:
            self.drop()
        failures: list[str] = []
        started = time.monotonic()
        for index, left_s in self.nodes.attempts(self.connect_timeout_s):
            self.failure, self.blocked, self.channel_error, self.broker_max_bytes = None, False, None, None
            failure = self._connect(index, left_s)
            if failure is None:
                self._connected(index)
                break
            self.nodes.failed(index)
            failures.append(f"{self.node_names[index]}: {failure}" if self.clustered else failure)
        else:
            raise self.unavailable("; ".join(failures) or self.NO_NODE)
        try:
            self._prepare()
            self.prove(max(PROBE_MIN_S, started + self.connect_timeout_s - time.monotonic()))
        except errors.BackendUnavailable:
            self.drop()
            raise
        except Exception as exc:  # noqa: BLE001 - the client raises many types; none may leak the URL
            reason = self.fail(exc)
            self.drop()
            raise self.unavailable(reason) from None

    def _connected(self, index: int) -> None:
        """Remember the node; say so when the drain moved to another node of a cluster."""
        moved = self.clustered and index != self._node
        self._node = index
        self.nodes.connected(index)
        self.generation += 1
        self._last_io = time.monotonic()
        if moved:
            log.info(
                "backend %s: connected to %s (node %d of %d)",
                self.name,
                self.node_names[index],
                index + 1,
                self.nodes.count,
                extra={"event": "broker_node", "backend": self.name, "node": self.node_names[index]},
            )

    def ensure_ready(self) -> None:
        """Make sure there is a usable channel to publish on (see the module docstring); raise
        BackendUnavailable."""
        idle = time.monotonic() - self._last_io > self.idle_limit_s
        if self.usable and not idle:
            try:
                self._wait(lambda: False, 0.0)
            except LinkDown as down:
                self.fail(down.reason)
        if not self.usable:
            self.open()
        elif idle:
            log.debug(
                "backend %s: reconnecting after an idle period", self.name, extra={"backend": self.name}
            )
            self.open()
        elif not self.ready:
            self._reopen_or_drop()
        self._after_ready()

    def _reopen_or_drop(self) -> None:
        self.channel_error = None
        try:
            self._reopen_channel()
        except LinkDown as down:
            raise self.give_up(down) from None

    def give_up(self, down: LinkDown) -> errors.BackendUnavailable:
        """Record ``down`` as the failure, drop the connection and say the backend is unavailable."""
        reason = self.fail(down.reason)
        self.drop()
        return self.unavailable(reason)

    def prove(self, timeout_s: float | None = None) -> None:
        """Write the probe and wait for its confirm, at most ``timeout_s`` (connect_timeout_s by
        default); raise BackendUnavailable, the connection dropped, when the broker blocks, nacks
        it or stays silent."""
        timeout_s = self.connect_timeout_s if timeout_s is None else timeout_s
        if self.usable and not self.ready:
            self._reopen_or_drop()
        tracker = self.tracker
        try:
            if not self.ready:
                raise LinkDown(self.failure or "no channel to publish on")
            self._write_probe()
            self._wait(lambda: tracker.probe is not None or not self.usable or not self.ready, timeout_s)
        except LinkDown as down:
            self.fail(down.reason)
        answered = not self.ready and self.channel_error is not None
        if self.usable and (tracker.probe or answered):
            return  # confirmed, or answered with a channel close: the broker reads our publishes
        reason = (
            self.failure
            or (BLOCKED if self.blocked else None)
            or ("the broker nacked a probe" if tracker.probe is False else None)
            or f"no confirm of a probe within {timeout_s:.1f}s"
        )
        self.drop()
        raise self.unavailable(reason)

    def ping(self) -> None:
        """Raise BackendUnavailable unless the broker takes a publish now: the connection is usable
        (reconnecting if it dropped) and a probe is confirmed."""
        self.ensure_ready()
        try:
            self._wait(lambda: False, 0.0)
        except LinkDown as down:
            self.fail(down.reason)
        if self.failure is not None or self.blocked:
            reason = self.failure or BLOCKED
            self.drop()
            raise self.unavailable(reason)
        self.prove()

    def close(self) -> None:
        """Close the connection politely (bounded), then release it. Idempotent."""
        if self.connection_open:
            self._close_politely()
        self.drop()

    def drop(self, reason: str | None = None) -> None:
        """Give up the connection at once (``reason``: why it failed): abandon every unconfirmed
        job and release the connection without the closing handshake."""
        if reason is not None:
            self.fail(reason)
        self.tracker.abandon(self.failure or "the connection was closed", retry=False)
        if self.failure is not None or self.blocked:
            self.nodes.lost()
        else:
            self.nodes.closed()
        self._release()


def _large_and_alone_in_its_key(
    jobs: Iterable[models.StagedJob],
) -> Callable[[tuple[models.StagedJob, Any, tuple[int, int]]], bool]:
    """The sort key that puts last a message of a write chunk's size or more whose ordering key
    (if any) no other job of the batch has: moving it changes no key's order."""
    keys = collections.Counter(job.ordering_key for job in jobs if job.ordering_key is not None)

    def goes_last(item: tuple[models.StagedJob, Any, tuple[int, int]]) -> bool:
        key = item[0].ordering_key
        return item[2][0] >= amqp_frames.WRITE_CHUNK_BYTES and (key is None or keys[key] == 1)

    return goes_last


class AmqpLink(Lifecycle[M]):
    """The connection and confirm-mode channel a backend publishes on: ``send`` a batch into a
    ticket, ``collect`` its confirms (see the module docstring)."""

    TOO_LARGE_HEADERS = "the headers are too large"

    def send(self, ticket: amqp_confirms.Ticket, items: Sequence[tuple[models.StagedJob, M]]) -> None:
        """Write each job's message (mandatory) into ``ticket`` and return at once; ``collect``
        waits for the confirms. A message the broker would refuse (over its max_message_size,
        a header frame over frame_max) is its job's rejection before it is sent; so is one whose
        write raised for a reason of its own (the client encodes a whole frame before writing it,
        so nothing of it reached the socket). When the channel or connection fails mid-batch, the
        jobs not written retry; raise BackendUnavailable when nothing of the batch went out.
        A library that holds the batch's messages to write them together (``_flush``) may leave
        the last ones unwritten for lack of time: they retry (no attempt), their delivery tags
        unused. A write of it cut short drops the connection: what the broker confirmed before
        counts, the rest retry; BackendUnavailable when nothing was confirmed.

        A message whose body is a write chunk's size or more goes after the others, unless another
        job of the batch has its ordering key (the relay's batches hold at most one row of a key):
        on a link slower than the batch, the messages before it are written and confirmed first,
        and it alone waits. The rest keep their order."""
        ticket.generation = self.generation
        self._begin_batch()
        measured = [(job, message, self._measure(message)) for job, message in items]
        if any(size >= amqp_frames.WRITE_CHUNK_BYTES for _, _, (size, _) in measured):
            measured.sort(key=_large_and_alone_in_its_key(job for job, _, _ in measured))
        taken = 0  # the messages _write took, in order
        for index, (job, message, (body_bytes, header_bytes)) in enumerate(measured):
            refusal = self._refusal(body_bytes, header_bytes)
            if refusal is not None:
                ticket.results.append(models.PublishResult.rejected(job, refusal))
                continue
            try:
                self._write(message)
            except LinkDown as down:
                reason = down.reason if down.channel_only else self.fail(down.reason)
                if not down.channel_only and not ticket.pending:  # as if there were no broker
                    self.drop()
                    raise self.unavailable(reason) from None
                reason = f"{self.label}: not sent: {reason}"
                ticket.results.extend(
                    models.PublishResult.retry(unsent, reason) for unsent, _, _ in measured[index:]
                )
                break
            except Exception as exc:  # noqa: BLE001 - this message's own fault: its rejection only
                reason = backend.refusal_text(self.label, exc, with_type=True)
                ticket.results.append(models.PublishResult.rejected(job, reason))
            else:
                self.tracker.sent(ticket, job, body_bytes)
                taken += 1
        try:
            written = self._flush()
        except LinkDown as down:  # else settled in collect: what was written may still be confirmed
            reason = self.fail(down.reason)
            if down.batch_lost:
                # The messages written whole before the cut may be confirmed already: what
                # arrived counts (the rest retry); with nothing confirmed, as if there were no
                # broker, like a first write that failed.
                self._last_look(ticket)
                self.drop()
                if not ticket.confirmed:
                    raise self.unavailable(reason) from None
        else:
            if written is not None and written < taken:
                # Left unwritten for lack of time (no frame of them on the wire): not an outage
                # nor the jobs' fault; they go with a later batch.
                self.tracker.unsent(ticket, taken - written, f"{self.label}: {NOT_WRITTEN}")
        self._last_io = time.monotonic()

    def _last_look(self, ticket: amqp_confirms.Ticket) -> None:
        """Handle the confirms already arrived for ``ticket`` on a connection that can carry
        nothing more (it is dropped next)."""
        try:
            while not ticket.settled and self._read_more():
                pass
        except LinkDown:
            pass

    def _refusal(self, body_bytes: int, header_bytes: int) -> str | None:
        if self.broker_max_bytes is not None and body_bytes > self.broker_max_bytes:
            return (
                f"{self.label}: message of {body_bytes} bytes exceeds the broker's max_message_size "
                f"({self.broker_max_bytes})"
            )
        if header_bytes > self.frame_max:
            # Built against another connection's frame_max, or too large for any: the broker
            # would close the connection, failing every job in flight.
            return (
                f"{self.label}: its header frame takes {header_bytes} bytes, more than one AMQP "
                f"frame (frame_max {self.frame_max}); {self.TOO_LARGE_HEADERS}"
            )
        return None

    def collect(self, ticket: amqp_confirms.Ticket) -> list[models.PublishResult]:
        """Wait for the ticket's confirms until its deadline; one result per job. Raises
        BackendUnavailable when nothing of it was confirmed and the broker failed, unless the
        link connected again since the ticket's connection was lost: then its jobs RETRY."""

        def done() -> bool:
            return ticket.settled or not self.usable or not self.ready

        if not ticket.settled:
            try:
                self._wait(done, ticket.remaining_s(self.publish_timeout_s))
                while not done() and self._read_more():  # past the deadline, what arrived counts
                    pass
            except LinkDown as lost:
                self.fail(lost.reason)
        if not ticket.settled:
            if self.channel_error is not None and self.usable:
                # Only the channel closed: its jobs retry, the connection stays.
                self.tracker.abandon(f"channel closed: {self.channel_error}", retry=True)
            else:
                self.fail(BLOCKED if self.blocked else f"no confirm within {self.publish_timeout_s}s")
                self.drop()
        if ticket.lost is not None and ticket.generation != self.generation and self.usable:
            # Its connection was lost before, and the link has connected (and proved the broker
            # takes publishes) since: its unconfirmed jobs retry; the backend is not down, and
            # saying so would drop the new connection with the batches in flight on it.
            ticket.lost_retry = True
        self._last_io = time.monotonic()
        results, down = amqp_confirms.close_out(ticket, self.label)
        if down is not None:
            raise self.unavailable(down)
        return results
