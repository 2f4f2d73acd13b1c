"""Publisher confirms and returns of one channel, per delivery tag, settled into tickets. No I/O.

Delivery tags count from 1 on each channel in confirm mode, one per ``basic.publish`` the broker
received, in order. How each job's outcome is decided::

    basic.return (NO_ROUTE) ... basic.ack  -> REJECTED  (RabbitMQ acks unroutable messages; the
                                                        return always arrives before the ack),
                                              or RETRY when the caller says the queue is one it
                                              declares (it declares it again before the retry)
    basic.ack (tag, or every tag <= it when multiple)   -> PUBLISHED
    basic.nack                                          -> RETRY
    channel closed: "message size N is larger than [configured] max size M" (406)
                                                        -> REJECTED for each unconfirmed job whose
                                                           body exceeds M; the rest as below
    the channel or connection went away                 -> the ticket is *lost* (see ``Ticket``)

A broker that closes the channel over one message's size fails every unconfirmed message on it;
the close names the sizes, not the message, so the jobs over the limit are found by their
recorded body sizes: each is refused (an attempt counted) and its neighbours are retried.

A probe (``probe_sent``: a tiny message that proves the broker takes publishes before a batch is
risked on a new connection) takes a delivery tag like any message; its confirm is kept apart
(``probe``: None while unconfirmed, then True for an ack, False for a nack).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import time

from drain import models

# RabbitMQ's channel error for a message over max_message_size (rabbit_channel in 3.x).
_OVERSIZE = re.compile(r"message size (\d+) is larger than (?:configured )?max size (\d+)")


def oversize_limit(reply_text: str) -> int | None:
    """The broker's ``max_message_size`` named by a channel close over a message's size, or None
    for any other close."""
    match = _OVERSIZE.search(reply_text)
    return int(match.group(2)) if match else None


@dataclasses.dataclass(eq=False)
class Ticket:
    """A submitted batch whose confirms are outstanding.

    ``pending`` maps each unconfirmed job's delivery tag to it; ``results`` holds what is settled
    (refused before sending, confirmed, returned, nacked). ``lost`` says why the channel that
    carried the rest went away: then they will never be confirmed. ``lost_retry``: only the
    channel failed (those jobs RETRY); otherwise the connection did, and a ticket of which
    nothing was confirmed means the backend is unavailable. ``deadline`` (monotonic seconds)
    is when waiting for its confirms ends: the publish timeout counts from the submission, so
    collecting several tickets in one step waits one publish timeout at most, not one each.
    ``generation`` is the connection (``LinkState.generation``) its messages were written on.
    """

    pending: dict[int, models.StagedJob] = dataclasses.field(default_factory=dict)
    results: list[models.PublishResult] = dataclasses.field(default_factory=list)
    confirmed: bool = False
    lost: str | None = None
    lost_retry: bool = False
    deadline: float | None = None
    generation: int = 0

    def remaining_s(self, timeout_s: float) -> float:
        """How long to wait for this ticket's confirms now (``timeout_s`` from now without a
        deadline; 0 once it passed)."""
        if self.deadline is None:
            return timeout_s
        return max(0.0, self.deadline - time.monotonic())

    @property
    def settled(self) -> bool:
        """Nothing more will happen to this ticket: every job has a result or its channel is gone."""
        return not self.pending or self.lost is not None


def close_out(ticket: Ticket, label: str) -> tuple[list[models.PublishResult], str | None]:
    """A ticket whose wait is over: (every job's result, None), or (what was settled, why the
    backend is unavailable) when its connection went away before anything of it was confirmed.
    Jobs still unconfirmed on a lost channel RETRY."""
    if not ticket.pending:
        return ticket.results, None
    unsettled = list(ticket.pending.values())
    ticket.pending = {}
    reason = ticket.lost or "the channel was closed"
    if not ticket.lost_retry and not ticket.confirmed:
        return ticket.results, reason
    ticket.results.extend(models.PublishResult.retry(job, f"{label}: {reason}") for job in unsettled)
    return ticket.results, None


class ConfirmTracker:
    """Which job each delivery tag of the current channel carries, and what became of it.

    ``label`` starts the reasons it writes (the backend type: ``rabbitmq``, ``celery``)."""

    def __init__(self, label: str = "rabbitmq") -> None:
        self.label = label
        self._next_tag = 1
        self._tickets: dict[int, Ticket] = {}  # delivery tag -> its ticket, in tag order
        self._sizes: dict[int, int] = {}  # delivery tag -> body bytes
        self._returned: dict[str, tuple[str, bool]] = {}  # message id -> (why returned, retry?)
        self._probe_tag: int | None = None
        self.probe: bool | None = None
        """The last probe's confirm: None until it came, then whether the broker acked it."""

    @property
    def outstanding(self) -> int:
        """Jobs sent on this channel and not confirmed yet."""
        return len(self._tickets)

    def sent(self, ticket: Ticket, job: models.StagedJob, body_bytes: int = 0) -> None:
        """``job`` (a body of ``body_bytes``) was just written with ``basic_publish`` on the
        current channel: it takes the next delivery tag."""
        ticket.pending[self._next_tag] = job
        self._tickets[self._next_tag] = ticket
        self._sizes[self._next_tag] = body_bytes
        self._next_tag += 1

    def unsent(self, ticket: Ticket, count: int, reason: str) -> None:
        """The last ``count`` jobs ``sent`` (all into ``ticket``) were never written: each RETRYs
        with ``reason`` (no attempt counted) and its delivery tag is given back, since the broker
        numbers only the messages it receives."""
        given_back: list[models.StagedJob] = []
        for _ in range(count):
            self._next_tag -= 1
            tag = self._next_tag
            assert self._tickets.pop(tag, None) is ticket, "only the last jobs sent are given back"
            self._sizes.pop(tag, None)
            given_back.append(ticket.pending.pop(tag))
        ticket.results.extend(models.PublishResult.retry(job, reason) for job in reversed(given_back))

    def probe_sent(self) -> None:
        """A probe was just written with ``basic_publish`` on the current channel: it takes the
        next delivery tag, and ``probe`` waits for its confirm."""
        self._probe_tag = self._next_tag
        self.probe = None
        self._next_tag += 1

    def returned(self, message_id: str, reason: str, *, retry: bool = False) -> None:
        """The broker returned a message (mandatory and unroutable); its ack follows. ``retry``:
        the job is retried without counting an attempt rather than rejected."""
        self._returned[message_id] = (reason, retry)

    def confirmed(self, tag: int, *, multiple: bool, acked: bool) -> None:
        """A ``basic.ack`` (``acked``) or ``basic.nack`` for ``tag`` (and every earlier tag when
        ``multiple``). Tags no ticket holds any more are ignored."""
        probe = self._probe_tag
        if probe is not None and (probe == tag or (multiple and probe < tag)):
            self._probe_tag = None
            self.probe = acked
        tags = list(itertools.takewhile(lambda t: t <= tag, self._tickets)) if multiple else [tag]
        for each in tags:
            self._sizes.pop(each, None)
            ticket = self._tickets.pop(each, None)
            job = None if ticket is None else ticket.pending.pop(each, None)
            if ticket is None or job is None:
                continue
            ticket.confirmed = True
            returned = self._returned.pop(str(job.job_id), None)
            if not acked:
                ticket.results.append(models.PublishResult.retry(job, f"{self.label}: the broker nacked it"))
            elif returned is None:
                ticket.results.append(models.PublishResult.published(job))
            elif returned[1]:
                ticket.results.append(models.PublishResult.retry(job, f"{self.label}: {returned[0]}"))
            else:
                ticket.results.append(models.PublishResult.rejected(job, f"{self.label}: {returned[0]}"))

    def refuse_larger(self, max_bytes: int, reason: str) -> None:
        """The broker closed the channel over a message larger than ``max_bytes``: each
        unconfirmed job whose body is larger is REJECTED with ``reason``; the channel is gone
        for the others, which RETRY."""
        for tag, ticket in self._tickets.items():
            if self._sizes.get(tag, 0) > max_bytes and (job := ticket.pending.pop(tag, None)):
                ticket.results.append(models.PublishResult.rejected(job, f"{self.label}: {reason}"))
        self.abandon(f"channel closed: {reason}", retry=True)

    def abandon(self, reason: str, *, retry: bool) -> None:
        """The channel that carried the outstanding tickets is gone: their unconfirmed jobs will
        never be confirmed (see ``Ticket.lost_retry``)."""
        for ticket in self._tickets.values():
            if ticket.lost is None:
                ticket.lost = reason
                ticket.lost_retry = retry
        self._tickets = {}
        self._sizes = {}
        self._returned = {}
        self._probe_tag = None

    def restart(self) -> None:
        """A new channel entered confirm mode: what the old one carried is lost, tags restart at 1."""
        self.abandon("the channel was replaced", retry=True)
        self._next_tag = 1
