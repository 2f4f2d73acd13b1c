"""The NATS JetStream backend: each staged job becomes one message on a subject a stream covers,
acknowledged by JetStream's PubAck.

What a consumer receives is in ``nats_messages``: subject ``<subject_prefix>.<queue>``,
``Nats-Msg-Id`` = ``<job id>:<row id>``, the JSON body of the RabbitMQ backend, and headers for the job name,
the ordering key, the trace context and a schedule's tick. The stream is the operator's: the
adapter never creates or edits one. ``open`` checks that a stream covers each subject of
``queues`` (or, without them, some subject under the prefix) and names the one that is not.

``submit`` writes the batch's messages, each with its own reply subject in the connection's inbox,
and returns a ticket; ``collect`` reads PubAcks until every message of that ticket is answered or
the publish timeout passes. Several tickets may be outstanding (the relay's ``pipeline_depth``).

What each answer means for its job (see docs/backends/nats.md)::

    PubAck                          -> PUBLISHED (a PubAck marked duplicate too: the stream
                                       holds the job since an earlier publish)
    error 10054 (over the stream's
      max_msg_size), 10097 (headers
      over 64 KiB); the message over
      the server's max_payload      -> REJECTED (the job's own size)
    no responders, and the JetStream
      API says no stream covers the
      subject; error 10077 "maximum
      ... exceeded" (a stream at its
      limit with discard new); the
      server's -ERR "Permissions
      Violation for Publish to <its
      subject>" (the connection and
      the other jobs go on)         -> RETRY: that queue's rows wait, paced, none dead-lettered
    no responders for a subject a
      stream covers (no leader, no
      quorum), any other error, no
      answer in time, the connection
      lost, any other permissions
      violation                     -> an outage: BackendUnavailable when nothing of the batch
                                       was published, else PUBLISHED for those and RETRY the
                                       rest; the connection is dropped and made again

The connection, the servers tried in turn within ``connect_timeout_s`` and the JetStream API
calls are ``nats_link``'s; a batch never waits beyond ``publish_timeout_s`` after its
submission. No payload, password or token appears in a log line or an error.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from drain import backend, errors, models
from drain.backend import deadline as call_deadline
from drain_adapters.nats import link as nats_link
from drain_adapters.nats import messages as nats_messages
from drain_adapters.nats import protocol
from drain_adapters.nats import settings as nats_settings

BACKEND_NAME = "nats"  # prefixes the reason of a job refused before sending
NO_RESPONDERS = nats_link.NO_RESPONDERS
TOO_LARGE = 10054  # JSStreamMessageExceedsMaximumErr
HEADERS_TOO_LARGE = 10097  # JSStreamHeaderExceedsMaximumErr: a header block over 64 KiB
STORE_FAILED = 10077  # JSStreamStoreFailedF: "maximum messages exceeded", ...
LOOKUP_TIMEOUT_S = 2.0  # one JetStream API call (which streams cover a subject)


@dataclasses.dataclass
class Ticket:
    """One batch in flight: its results so far, its jobs awaiting an answer, and its deadline."""

    deadline: float
    connection: protocol.Connection | None = None
    """The connection it was written on: its answers come on no other."""
    results: list[models.PublishResult] = dataclasses.field(default_factory=list)
    waiting: dict[int, models.StagedJob] = dataclasses.field(default_factory=dict)
    """Reply token -> job, for the jobs written and not answered yet."""
    unplaced: list[tuple[models.StagedJob, str]] = dataclasses.field(default_factory=list)
    """Jobs answered "no responders", with their subject: is a stream there at all?"""
    failed: list[tuple[models.StagedJob, str]] = dataclasses.field(default_factory=list)
    """Jobs whose failure is the backend's (an outage), with the reason."""
    positions: dict[int, int] = dataclasses.field(default_factory=dict)
    """Row id -> its place in the batch: the results come back in the batch's order."""


class NatsAdapter:
    """Publish staged jobs to NATS JetStream, each acknowledged by a PubAck; see the module docstring."""

    def __init__(self, name: str, settings: nats_settings.NatsSettings) -> None:
        self.name = name
        self.settings = settings
        self._owners: dict[int, Ticket] = {}
        """Reply token -> the ticket awaiting it, on the link's connection."""
        self._link = nats_link.NatsLink(name, settings, self._deliver, self._owners.clear)
        self._subjects = nats_messages.Subjects(settings.subject_prefix)
        self._deadline = call_deadline.Deadline(settings.publish_timeout_s)

    def __repr__(self) -> str:
        return f"NatsAdapter({self.name!r}, {self.settings!r})"

    @classmethod
    def from_options(cls, name: str, options_: Mapping[str, Any], *, publish_timeout_s: float) -> NatsAdapter:
        return cls(name, nats_settings.NatsSettings.parse(name, options_, publish_timeout_s))

    # --- the contract ---------------------------------------------------------------------------

    def open(self) -> None:
        """Connect (trying the servers in turn), prove JetStream answers, and check that a stream
        covers the configured subjects; BackendUnavailable naming the first one not covered. The
        lookups and the batch right after share one deadline (``drain.backend.deadline``)."""
        opened_by = self._deadline.opening()
        self._link.ensure_connected()
        prefix = self.settings.subject_prefix
        subjects = [f"{prefix}.{queue}" for queue in self.settings.queues] or [f"{prefix}.>"]
        for subject in subjects:
            lookup_by = min(opened_by, time.monotonic() + self.settings.connect_timeout_s)
            if not self._link.streams_covering(subject, lookup_by):
                raise self._link.unavailable(
                    f"no stream covers subject {subject!r}: the operator creates one "
                    "(the drain never creates or edits streams)",
                    drop=False,
                )

    def ping(self) -> None:
        """Raise BackendUnavailable unless a server answers and JetStream with it."""
        self._link.ensure_connected()
        self._link.jetstream_answers()

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        return self.collect(self.submit(jobs))

    def submit(self, jobs: Sequence[models.StagedJob], /) -> Ticket:
        """Write the batch and return at once; ``collect`` waits for its PubAcks.

        Jobs refused before publishing are settled in the ticket already. Raises
        BackendUnavailable when there is no connection to write on.
        """
        ticket = Ticket(deadline=self._deadline.start())
        ticket.positions = {job.id: place for place, job in enumerate(jobs)}
        connection = self._link.ensure_connected()
        build = functools.partial(
            nats_messages.build, subjects=self._subjects, max_payload=connection.max_payload
        )
        built, ticket.results = backend.build_each(jobs, build, BACKEND_NAME)
        if not built:
            return ticket
        ticket.connection = connection
        pending: list[bytes] = []
        size = 0
        inbox = connection.inbox
        owners, waiting = self._owners, ticket.waiting
        try:
            for token, (job, message) in zip(self._link.next_tokens(len(built)), built, strict=True):
                owners[token] = ticket
                waiting[token] = job
                headers, body = message.headers, message.body
                length = len(headers) + len(body)
                line = b"HPUB %s %s.%d %d %d\r\n" % (message.subject, inbox, token, len(headers), length)
                pending += (line, headers, body, b"\r\n")  # joined once per chunk
                size += length
                if size >= protocol.WRITE_CHUNK:
                    connection.send(b"".join(pending), ticket.deadline)
                    pending, size = [], 0
            if pending:
                connection.send(b"".join(pending), ticket.deadline)
        except protocol.LinkDown as exc:
            raise self._link.unavailable(self.settings.describe(str(exc))) from None
        return ticket

    def collect(self, ticket: Ticket, /) -> list[models.PublishResult]:
        """Wait for the ticket's PubAcks until publish_timeout_s after its submission; one
        result per job. Raises BackendUnavailable when nothing of it was published and the
        backend failed; a batch written on a connection since replaced by a live one is RETRY
        for what was not acknowledged (the new connection carries the next batches)."""
        connection = self._link.connection
        lost = "the connection was lost before the acknowledgement"
        replaced = connection is not None and not connection.closed and connection is not ticket.connection
        if connection is not ticket.connection:
            connection = None  # written on a connection since dropped: no answer can come
        while ticket.waiting and connection is not None:
            if connection.denied:
                self._deny(connection)
                continue
            if connection.refusal:
                self._fail_waiting(ticket, connection.refusal)
                break
            if time.monotonic() >= ticket.deadline:
                self._fail_waiting(ticket, "no acknowledgement within publish_timeout_s")
                break
            try:
                self._link.read(connection, ticket.deadline)
            except protocol.LinkDown as exc:
                lost = self.settings.describe(str(exc))
                self._link.drop(lost)
                break
        if ticket.waiting:  # the connection was lost before or while waiting
            self._fail_waiting(ticket, lost)
        self._place(ticket)
        ticket.results.sort(key=lambda result: ticket.positions.get(result.row_id, 0))
        if not ticket.failed:
            return ticket.results
        reason = ticket.failed[0][1]
        published = any(result.outcome is models.Outcome.PUBLISHED for result in ticket.results)
        if not published and not replaced:
            raise self._link.unavailable(reason)
        if not replaced:
            self._link.drop(reason)
        retried = [models.PublishResult.retry(job, f"nats: {why}") for job, why in ticket.failed]
        return ticket.results + retried

    def close(self) -> None:
        """Release the connection and forget the batches in flight. Idempotent."""
        self._link.drop(None)

    # --- answers --------------------------------------------------------------------------------

    def _deliver(self, reply: protocol.Reply) -> None:
        """One reply from the inbox to a job: its PubAck, or why there is none."""
        ticket = self._owners.pop(reply.token, None)
        job = None if ticket is None else ticket.waiting.pop(reply.token, None)
        if ticket is None or job is None:
            return  # a late answer for a batch given up
        if reply.status == NO_RESPONDERS:
            subject = f"{self.settings.subject_prefix}.{job.queue}"
            ticket.unplaced.append((job, subject))
            return
        if reply.status is not None:
            ticket.failed.append((job, f"status {reply.status} instead of a PubAck"))
            return
        if b'"error"' not in reply.payload and b'"seq"' in reply.payload:
            ticket.results.append(models.PublishResult.published(job))  # a PubAck: no need to parse it
            return
        try:
            ack = json.loads(reply.payload)
        except ValueError:
            ticket.failed.append((job, "an answer that is no PubAck"))
            return
        problem = ack.get("error") if isinstance(ack, dict) else "not an object"
        if problem is None and isinstance(ack, dict) and "seq" in ack:
            ticket.results.append(models.PublishResult.published(job))
            return
        code = problem.get("err_code") if isinstance(problem, dict) else None
        text = problem.get("description", "") if isinstance(problem, dict) else str(problem)
        reason = f"JetStream refused: {text} (err_code {code})"[:300]
        if code in (TOO_LARGE, HEADERS_TOO_LARGE):
            ticket.results.append(models.PublishResult.rejected(job, f"nats: {reason}"))
        elif code == STORE_FAILED and "maximum" in text and "exceeded" in text:
            ticket.results.append(models.PublishResult.retry(job, f"nats: the stream is full: {reason}"))
        else:
            ticket.failed.append((job, reason))

    def _deny(self, connection: protocol.Connection) -> None:
        """The subjects the server refused to take a publish on (a permissions violation naming
        each): every job of theirs awaiting a PubAck, in any batch, waits (RETRY). The refusal
        names the subject, so it is that queue's; the server keeps the connection open and the
        other jobs' PubAcks come."""
        denied = set(connection.denied)
        connection.denied.clear()
        prefix = self.settings.subject_prefix
        for token, ticket in list(self._owners.items()):
            job = ticket.waiting.get(token)
            subject = None if job is None else f"{prefix}.{job.queue}"
            if job is not None and subject in denied:
                del ticket.waiting[token], self._owners[token]
                reason = f"nats: the server denies publishing to subject {subject!r} (permissions)"
                ticket.results.append(models.PublishResult.retry(job, reason[:300]))

    def _fail_waiting(self, ticket: Ticket, reason: str) -> None:
        for token, job in ticket.waiting.items():
            self._owners.pop(token, None)
            ticket.failed.append((job, reason))
        ticket.waiting.clear()

    def _place(self, ticket: Ticket) -> None:
        """Decide each "no responders": no stream covers the subject -> that queue's rows wait
        (every job of the queue meets it: the topology's fault, never the row's); a stream does
        (it has no leader now) or JetStream cannot say -> an outage."""
        verdicts: dict[str, list[str] | None] = {}
        for job, subject in ticket.unplaced:
            if subject not in verdicts:
                deadline = min(ticket.deadline, time.monotonic() + LOOKUP_TIMEOUT_S)
                try:
                    verdicts[subject] = self._link.streams_covering(subject, deadline)
                except errors.BackendUnavailable:
                    verdicts[subject] = None
            streams = verdicts[subject]
            if streams is None:
                ticket.failed.append((job, f"no responders for {subject!r}, and JetStream did not answer"))
            elif streams:
                shown = ", ".join(streams[:3])
                ticket.failed.append(
                    (job, f"stream {shown} covers {subject!r} but did not answer (no leader?)")
                )
            else:
                ticket.results.append(
                    models.PublishResult.retry(job, f"nats: no stream covers subject {subject!r}")
                )
        ticket.unplaced.clear()
