"""The NATS backend's link to the cluster: which server to connect to, proving JetStream answers
there, the JetStream API calls the backend makes, and dropping a connection that failed.

One connection at a time (``protocol.Connection``), made on demand: the servers are tried in turn
within ``connect_timeout_s`` (``drain_adapters.amqp.nodes``), and a new connection counts only
once JetStream answered on it (``$JS.API.INFO``). A connection idle for IDLE_CHECK_S is proved
with a PING before it carries a batch. Replies to the inbox that answer none of the link's own
requests (the PubAcks) go to ``on_reply``; ``on_drop`` hears that the connection is gone, with
every answer still owed on it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from drain import errors
from drain_adapters.amqp import nodes
from drain_adapters.nats import protocol
from drain_adapters.nats import settings as nats_settings

log = logging.getLogger(__name__)

NO_RESPONDERS = 503
IDLE_CHECK_S = 30.0  # a connection idle this long is proved with a PING before a batch


class NatsLink:
    """The backend's connection and the JetStream API on it; see the module docstring."""

    def __init__(
        self,
        name: str,
        settings: nats_settings.NatsSettings,
        on_reply: Callable[[protocol.Reply], None],
        on_drop: Callable[[], None],
    ) -> None:
        self.name = name
        self.settings = settings
        self.label = f"nats backend {name}: "  # begins every BackendUnavailable's message
        self.connection: protocol.Connection | None = None
        self._on_reply = on_reply
        self._on_drop = on_drop
        self._rotation = nodes.NodeRotation(len(settings.servers))
        self._answers: dict[int, protocol.Reply | None] = {}
        self._tokens = 0
        self._server: int | None = None  # the index of the server last connected to

    def next_token(self) -> int:
        """A reply token no other message of this link has had."""
        self._tokens += 1
        return self._tokens

    def next_tokens(self, count: int) -> range:
        """``count`` reply tokens no other message of this link has had."""
        first = self._tokens + 1
        self._tokens += count
        return range(first, first + count)

    def read(self, connection: protocol.Connection, deadline: float) -> None:
        """Read what ``connection`` delivers until something came or ``deadline`` passed."""
        connection.read(deadline, self._answer)

    def _answer(self, reply: protocol.Reply) -> None:
        if reply.token in self._answers:
            self._answers[reply.token] = reply
        else:
            self._on_reply(reply)

    # --- the JetStream API ----------------------------------------------------------------------

    def request(self, subject: str, payload: bytes, deadline: float) -> protocol.Reply:
        """One request to the JetStream API on the inbox; BackendUnavailable without an answer."""
        connection = self.require()
        token = self.next_token()
        self._answers[token] = None
        try:
            connection.send(
                b"PUB %s %s.%d %d\r\n%s\r\n"
                % (subject.encode(), connection.inbox, token, len(payload), payload),
                deadline,
            )
            while self._answers[token] is None and time.monotonic() < deadline:
                connection.read(deadline, self._answer)
        except protocol.LinkDown as exc:
            raise self.unavailable(str(exc)) from None
        finally:
            reply = self._answers.pop(token, None)
        if reply is None:
            raise self.unavailable(f"JetStream did not answer {subject.split('.')[2]} in time", drop=False)
        if reply.status == NO_RESPONDERS:
            raise self.unavailable("JetStream is not enabled for this account, or not available", drop=False)
        return reply

    def streams_covering(self, subject: str, deadline: float) -> list[str]:
        """The streams whose subjects take ``subject`` (a wildcard subject: overlap it)."""
        reply = self.request("$JS.API.STREAM.NAMES", json.dumps({"subject": subject}).encode(), deadline)
        try:
            answer = json.loads(reply.payload)
        except ValueError:
            raise self.unavailable("JetStream's stream list is no JSON", drop=False) from None
        if not isinstance(answer, dict) or answer.get("error"):
            problem = answer.get("error") if isinstance(answer, dict) else answer
            raise self.unavailable(f"JetStream refused to list streams: {str(problem)[:200]}", drop=False)
        return [str(stream) for stream in answer.get("streams") or []]

    def jetstream_answers(self) -> None:
        """BackendUnavailable unless JetStream answers for this account on the connection."""
        deadline = time.monotonic() + self.settings.connect_timeout_s
        reply = self.request("$JS.API.INFO", b"", deadline)
        try:
            answer = json.loads(reply.payload)
        except ValueError:
            raise self.unavailable("JetStream's account info is no JSON", drop=False) from None
        problem = answer.get("error") if isinstance(answer, dict) else "not an object"
        if problem:
            raise self.unavailable(f"JetStream refused: {str(problem)[:200]}", drop=False)

    # --- the connection -------------------------------------------------------------------------

    def ensure_connected(self) -> protocol.Connection:
        """The live connection, or a new one (the servers tried in turn within connect_timeout_s)."""
        connection = self.connection
        if connection is not None and not connection.closed:
            try:
                connection.poll(self._answer)
                if time.monotonic() - connection.last_io > IDLE_CHECK_S:
                    self._prove(connection)
                return connection
            except protocol.LinkDown as exc:
                self.drop(str(exc))
        failures = []
        for index, left in self._rotation.attempts(self.settings.connect_timeout_s):
            server = self.settings.servers[index]
            try:
                connection = protocol.Connection.connect(server, self.settings, left)
            except protocol.LinkDown as exc:
                self._rotation.failed(index)
                failures.append(self.settings.describe(str(exc)))
                continue
            self.connection = connection
            self._rotation.connected(index)
            try:
                self.jetstream_answers()
            except errors.BackendUnavailable as exc:
                reason = str(exc).removeprefix(self.label)
                self.drop(reason)
                self._rotation.failed(index)
                failures.append(f"{server}: {reason}")
                continue
            if len(self.settings.servers) > 1 and index != self._server:
                log.info(
                    "backend %s: connected to %s (server %d of %d)",
                    self.name,
                    server,
                    index + 1,
                    len(self.settings.servers),
                    extra={"event": "broker_node", "backend": self.name, "node": str(server)},
                )
            self._server = index
            return connection
        raise errors.BackendUnavailable(
            f"{self.label}no server answered: " + "; ".join(failures or ["no time left"])
        )

    def _prove(self, connection: protocol.Connection) -> None:
        """A PING answered within connect_timeout_s, or LinkDown."""
        pongs = connection.pongs
        deadline = time.monotonic() + self.settings.connect_timeout_s
        connection.send(b"PING\r\n", deadline)
        while connection.pongs == pongs:
            if time.monotonic() >= deadline:
                raise protocol.LinkDown("no PONG within connect_timeout_s")
            connection.read(deadline, self._answer)

    def require(self) -> protocol.Connection:
        connection = self.connection
        if connection is None or connection.closed:
            raise errors.BackendUnavailable(f"{self.label}not connected")
        return connection

    def drop(self, reason: str | None) -> None:
        connection, self.connection = self.connection, None
        self._answers.clear()
        self._on_drop()
        if connection is None:
            return
        connection.close()
        if reason is not None:
            self._rotation.lost()
            log.warning(
                "backend %s: connection dropped: %s",
                self.name,
                self.settings.describe(reason),
                extra={"event": "backend_connection_lost", "backend": self.name},
            )
        else:
            self._rotation.closed()

    def unavailable(self, reason: str, *, drop: bool = True) -> errors.BackendUnavailable:
        text = self.settings.describe(reason)
        if drop:
            self.drop(text)
        return errors.BackendUnavailable(f"{self.label}{text}")
