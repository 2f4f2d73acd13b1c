"""Publisher confirms and returns of one channel, per delivery tag, settled into tickets. No I/O.

Delivery tags count from 1 on each channel in confirm mode, one per ``basic.publish`` the broker
received, in order. How each job's outcome is decided::

    basic.return (NO_ROUTE) ... basic.ack  -> REJECTED  (RabbitMQ acks unroutable messages; the
                                                        return always arrives before the ack)
    basic.ack (tag, or every tag <= it when multiple)   -> PUBLISHED
    basic.nack                                          -> RETRY
    the channel or connection went away                 -> the ticket is *lost* (see ``Ticket``)
"""

from __future__ import annotations

import dataclasses
import itertools

from drain import models


@dataclasses.dataclass(eq=False)
class Ticket:
    """A submitted batch whose confirms are outstanding.

    ``pending`` maps each unconfirmed job's delivery tag to it; ``results`` holds what is settled
    (refused before sending, confirmed, returned, nacked). ``lost`` says why the channel that
    carried the rest went away: then they will never be confirmed. ``lost_retry``: only the
    channel failed (those jobs RETRY); otherwise the connection did, and a ticket of which
    nothing was confirmed means the backend is unavailable.
    """

    pending: dict[int, models.StagedJob] = dataclasses.field(default_factory=dict)
    results: list[models.PublishResult] = dataclasses.field(default_factory=list)
    confirmed: bool = False
    lost: str | None = None
    lost_retry: bool = False

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
        self._returned: dict[str, str] = {}  # message id -> why the broker returned it

    @property
    def outstanding(self) -> int:
        """Jobs sent on this channel and not confirmed yet."""
        return len(self._tickets)

    def sent(self, ticket: Ticket, job: models.StagedJob) -> None:
        """``job`` was just written with ``basic_publish`` on the current channel: it takes the
        next delivery tag."""
        ticket.pending[self._next_tag] = job
        self._tickets[self._next_tag] = ticket
        self._next_tag += 1

    def returned(self, message_id: str, reason: str) -> None:
        """The broker returned a message (mandatory and unroutable); its ack follows."""
        self._returned[message_id] = reason

    def confirmed(self, tag: int, *, multiple: bool, acked: bool) -> None:
        """A ``basic.ack`` (``acked``) or ``basic.nack`` for ``tag`` (and every earlier tag when
        ``multiple``). Tags no ticket holds any more are ignored."""
        tags = list(itertools.takewhile(lambda t: t <= tag, self._tickets)) if multiple else [tag]
        for each in tags:
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
            else:
                ticket.results.append(models.PublishResult.rejected(job, f"{self.label}: {returned}"))

    def abandon(self, reason: str, *, retry: bool) -> None:
        """The channel that carried the outstanding tickets is gone: their unconfirmed jobs will
        never be confirmed (see ``Ticket.lost_retry``)."""
        for ticket in self._tickets.values():
            if ticket.lost is None:
                ticket.lost = reason
                ticket.lost_retry = retry
        self._tickets = {}
        self._returned = {}

    def restart(self) -> None:
        """A new channel entered confirm mode: what the old one carried is lost, tags restart at 1."""
        self.abandon("the channel was replaced", retry=True)
        self._next_tag = 1
