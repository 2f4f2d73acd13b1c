"""The RQ backend: each staged job becomes a real RQ job that a plain ``rq worker`` runs.

An RQ job is ``func=job_name`` (a dotted path the worker imports), the row's args and kwargs, and
``job_id`` = the row's job id. Each row is first turned into its Redis writes through
``drain.backend.build_each`` (``rq_rules`` checks the name and options as RQ and its worker would,
``rq_message`` computes the hash fields ``Queue.enqueue_many`` writes; no I/O): a row RQ would
refuse is that row's rejection, never a crash and never "backend unavailable".

Then the whole batch is one script call (``rq_script``), one round trip: per job it skips the
duplicate a crash between Redis's reply and the database commit leaves (the job hash carries
this row's mark), rejects a row whose job id RQ holds for something else (a failed job kept for
its failure_ttl, a job enqueued elsewhere), retries one whose queue key is not a list, and
writes the rest.
The reply is the acknowledgement (with ``wait_replicas``, once that many replicas have the batch).
In a backlog the relay submits a full batch (``submit``) on a connection of the adapter's own
(``redis_client.Pipe``) and reads its reply a step later (``collect``), so Redis runs one batch's
script while the drain selects the next; a partial batch is published at once (``publish_batch``).
A write Redis refuses stops the script there, and the script names the key whose write was
refused: the queue's own key holding another type makes that queue's rows wait (RETRY, no
attempt counted); any other refusal (the job's key, the shared ``rq:queues``, an ACL, OOM,
READONLY, ...) raises BackendUnavailable and the rows wait untouched (``redis_errors``).
Redis is reached by URL or through Sentinel (``redis_client``, ``redis_settings``).
Each call (``open`` and the batch after it together, a batch, its ``WAIT``, a ping) ends within
``publish_timeout_s`` however many round trips it takes (``drain.backend.deadline``); a
submitted batch's reply is awaited until ``publish_timeout_s`` after its submission.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from rq import serializers

from drain import backend, errors, models
from drain.backend import allowlist, options
from drain.backend import deadline as call_deadline
from drain_adapters.redis import client as redis_client
from drain_adapters.redis import errors as redis_errors
from drain_adapters.redis import probes as redis_probes
from drain_adapters.redis import settings as redis_settings
from drain_adapters.rq import message as rq_message
from drain_adapters.rq import rules as rq_rules
from drain_adapters.rq import script as rq_script

log = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
SERIALIZERS: dict[str, rq_message.Serializer] = {
    "pickle": serializers.DefaultSerializer.dumps,
    "json": serializers.JSONSerializer.dumps,
}
MAX_REMEMBERED_NAMES = 4096  # job names whose check is remembered (the set is cleared when full)
MAX_REMEMBERED_NAME_CHARS = 512


@dataclasses.dataclass(frozen=True)
class RQSettings:
    """``[backends.<name>]`` with ``type = "rq"``."""

    url: str = dataclasses.field(default=DEFAULT_URL, repr=False)
    allowed_jobs: tuple[str, ...] | None = None
    wildcards_with_checked_workers: bool = False
    """The operator's word that every worker runs ``--job-class drain_adapters.rq.job.CheckedJob``."""
    serializer: str = "pickle"
    socket_timeout_s: float = 5.0
    publish_timeout_s: float = 10.0
    """The bound on a whole call (the drain's ``publish_timeout_s``); ``socket_timeout_s`` bounds
    each wait within it."""
    sentinel: redis_client.SentinelTarget | None = None
    wait: redis_settings.Wait = dataclasses.field(default_factory=redis_settings.Wait)

    @classmethod
    def parse(cls, name: str, values: Mapping[str, Any], publish_timeout_s: float) -> RQSettings:
        reader = options.OptionReader(values, f"backends.{name}.")
        target = redis_settings.read_rq_target(reader, values, DEFAULT_URL)
        timeout_s = reader.timeout("socket_timeout_s", min(5.0, publish_timeout_s), publish_timeout_s)
        settings = cls(
            url=target if isinstance(target, str) else DEFAULT_URL,
            allowed_jobs=reader.strings("allowed_jobs"),
            wildcards_with_checked_workers=reader.boolean("wildcards_with_checked_workers", False),
            serializer=reader.string("serializer", "pickle") or "pickle",
            socket_timeout_s=timeout_s,
            publish_timeout_s=publish_timeout_s,
            sentinel=None if isinstance(target, str) else target,
            wait=redis_settings.read_wait(reader, timeout_s, "socket_timeout_s"),
        )
        if settings.serializer not in SERIALIZERS:
            reader.problem("serializer", f"must be one of {', '.join(SERIALIZERS)}")
        if settings.allowed_jobs is not None:
            for problem in rq_rules.allowed_jobs_problems(
                settings.allowed_jobs, wildcards=settings.wildcards_with_checked_workers
            ):
                reader.problem("allowed_jobs", problem)
        elif settings.wildcards_with_checked_workers:
            reader.problem("wildcards_with_checked_workers", "only means something with allowed_jobs")
        problems = reader.finish()
        if problems:
            raise errors.ConfigError(problems)
        return settings


@dataclasses.dataclass
class Ticket:
    """A submitted batch: its messages (sent on the pipe in ``generation``) and the results
    known at once (the rows refused while building)."""

    pending: list[tuple[models.StagedJob, rq_message.RQMessage]]
    results: list[models.PublishResult]
    pipe: redis_client.Pipe | None = None
    generation: int = -1
    deadline: float = 0.0


class RQAdapter:
    """Enqueue staged jobs as RQ jobs."""

    full_batches_only = True
    """The relay submits only full batches: a reply comes within one round trip, so pipelining
    pays in a backlog and a partial batch is published at once (drain.backend.PipelinedAdapter)."""

    def __init__(self, name: str, settings: RQSettings) -> None:
        self.name = name
        self.settings = settings
        self._label = f"redis backend {name}"
        self._link: redis_client.RedisLink | None = None
        self._pipe: redis_client.Pipe | None = None
        self._deadline = call_deadline.Deadline(settings.publish_timeout_s)
        self._dumps = SERIALIZERS[settings.serializer]
        self._allowed: allowlist.Allowlist | None = None
        if settings.allowed_jobs is not None:
            self._allowed = allowlist.Allowlist.parse(settings.allowed_jobs, allow_double_star=False)[0]
        self._names: dict[str, str | None] = {}  # job_name -> refusal reason (None = allowed)
        if settings.allowed_jobs is None:
            log.warning(
                "backend %s: no allowed_jobs; any row can make the RQ workers import and run any "
                "function of any module (list your task functions: `drain allowed-jobs app.tasks` "
                "prints them)",
                name,
                extra={"event": "no_allowed_jobs", "backend": name},
            )
        elif any(rq_rules.is_wildcard(pattern) for pattern in settings.allowed_jobs):
            log.warning(
                "backend %s: allowed_jobs has wildcards, which admit whatever the modules import; "
                "they are safe only while every RQ worker runs --job-class "
                "drain_adapters.rq.job.CheckedJob (wildcards_with_checked_workers = true)",
                name,
                extra={"event": "rq_wildcards", "backend": name},
            )

    @classmethod
    def from_options(cls, name: str, options_: Mapping[str, Any], *, publish_timeout_s: float) -> RQAdapter:
        return cls(name, RQSettings.parse(name, options_, publish_timeout_s))

    def open(self) -> None:
        self.close()
        timeout_s, deadline = self.settings.socket_timeout_s, self._deadline
        try:
            target = self.settings.sentinel or self.settings.url
            self._link = redis_client.RedisLink(target, timeout_s, deadline)
            self._pipe = redis_client.Pipe(redis_client.RedisLink(target, timeout_s, deadline))
        except ValueError as exc:  # a URL query redis-py refuses; its text may quote the URL
            reason = f"{self._label}: the url is refused: {type(exc).__name__}"
            raise errors.BackendUnavailable(reason) from None
        deadline.opening()
        with redis_errors.translated(self._label):
            self._client().ping()
            self.settings.wait.ready(self._client(), self._label)
            self._pipe.connect()

    def ping(self) -> None:
        self._deadline.start()
        with redis_errors.translated(self._label):
            self._client().ping()

    def problems(self) -> list[str]:
        """What the drain needs in Redis and does not find (``drain check``): ``rq:queues`` a
        set, the job and queue key patterns and ``rq:queues`` writable by the drain's user
        (``redis_probes``), and the batch script allowed (run for no job: it writes nothing)."""
        client = self._client()
        self._deadline.start()
        keys = [
            (rq_message.QUEUES_KEY.decode(), "set"),
            (redis_probes.absent_key(rq_message.JOB_PREFIX), "hash"),
            (redis_probes.absent_key(rq_message.QUEUE_PREFIX), "list"),
        ]
        with redis_errors.translated(self._label):
            found = redis_probes.key_problems(client, keys)
            try:
                self.run_script([])
            except redis.ResponseError as exc:
                found.append(f"may not run the drain's script: {redis_errors.reason(exc)}")
        return found

    def close(self) -> None:
        link, self._link = self._link, None
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            pipe.close()
        if link is not None:
            link.close()

    def _open_link(self) -> redis_client.RedisLink:
        if self._link is None:
            raise errors.BackendUnavailable(f"{self._label} is not open")
        return self._link

    def _client(self) -> Any:
        return self._open_link().client

    def build(self, job: models.StagedJob, now: bytes) -> rq_message.RQMessage:
        """The Redis writes for one row, or JobRefused / any exception: that row's rejection."""
        func_name = self._checked_name(job.job_name)
        checked = rq_rules.check_options(job.options)
        return rq_message.build(job, func_name, checked, self._dumps, now)

    def _checked_name(self, name: str) -> str:
        """check_job_name, remembered per name: a drain sees the same few names again and again."""
        try:
            reason = self._names[name]
        except (KeyError, TypeError):
            try:
                rq_rules.check_job_name(name, self._allowed, self.name)
                reason = None
            except errors.JobRefused as exc:
                reason = str(exc)
            if isinstance(name, str) and len(name) <= MAX_REMEMBERED_NAME_CHARS:
                if len(self._names) >= MAX_REMEMBERED_NAMES:
                    self._names.clear()
                self._names[name] = reason
        if reason is not None:
            raise errors.JobRefused(reason)
        return name

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        self._deadline.start()  # every call starts one, a call after open that sends nothing too
        ticket = self._built(jobs)
        if not ticket.pending:
            return ticket.results
        return self._answered(ticket.pending, self._run(ticket.pending), ticket.results)

    def submit(self, jobs: Sequence[models.StagedJob], /) -> Ticket:
        """Send the batch's script call (and ``WAIT``) on the pipe; ``collect`` reads the reply."""
        deadline = self._deadline.start()
        ticket = self._built(jobs)
        if ticket.pending:
            if self._pipe is None:
                raise errors.BackendUnavailable(f"{self._label} is not open")
            packed = rq_script.command([message for _, message in ticket.pending])
            wait = self.settings.wait.command()
            with redis_errors.translated(self._label):
                ticket.deadline = deadline
                ticket.pipe = self._pipe
                ticket.generation = self._pipe.send(packed + wait, 2 if wait else 1)
        return ticket

    def collect(self, ticket: Ticket, /) -> list[models.PublishResult]:
        """The submitted batch's results. Its connection lost since (a later submit connected
        again): every job RETRY, Redis may hold it or not. The adapter closed: unavailable."""
        if not ticket.pending:
            return ticket.results
        pipe = self._pipe
        if pipe is None or pipe is not ticket.pipe:
            raise errors.BackendUnavailable(f"{self._label}: closed before the batch's reply")
        self._deadline.until(ticket.deadline)
        try:
            with redis_errors.translated(self._label):
                replies = self._read(pipe, ticket)
        except redis_client.Pipe.Lost:
            why = f"{self._label}: the connection was lost before the batch's reply"
            return ticket.results + [models.PublishResult.retry(job, why) for job, _ in ticket.pending]
        return self._answered(ticket.pending, replies, ticket.results)

    def _read(self, pipe: redis_client.Pipe, ticket: Ticket) -> list[Any]:
        """The script's replies for a ticket (then WAIT's, checked); a script Redis no longer
        knows (restarted, failed over) is given it and the batch run again, on the link."""
        refused: redis.ResponseError | None = None
        try:
            replies = list(pipe.read(ticket.generation))
        except redis.ResponseError as exc:  # the call's error reply: WAIT's reply is still owed
            refused, replies = exc, []
        if self.settings.wait.replicas:
            self.settings.wait.verify(pipe.read(ticket.generation), self._label)
        if isinstance(refused, redis.exceptions.NoScriptError):
            return self._run(ticket.pending)
        if refused is not None:
            raise refused
        return replies

    def _built(self, jobs: Sequence[models.StagedJob]) -> Ticket:
        now = rq_message.timestamp()
        built, results = backend.build_each(jobs, lambda job: self.build(job, now), self.name)
        return Ticket(built, results)

    def _run(self, pending: Sequence[tuple[models.StagedJob, rq_message.RQMessage]]) -> list[Any]:
        """One script call for ``pending`` on the link, with WAIT; its replies."""
        with redis_errors.translated(self._label):
            replies = self.run_script([message for _, message in pending])
            self.settings.wait.check(self._client(), self._label)
        return replies

    def _answered(
        self,
        pending: list[tuple[models.StagedJob, rq_message.RQMessage]],
        replies: list[Any],
        results: list[models.PublishResult],
    ) -> list[models.PublishResult]:
        """Each job's result from its reply. The script stops at a job whose own write Redis
        refused: the jobs after it go again, in a call of their own."""
        while True:
            if not replies:
                raise errors.BackendUnavailable(f"{self._label}: the script replied nothing")
            answered = zip(pending, replies, strict=False)
            results.extend(self._result(job, message, reply) for (job, message), reply in answered)
            pending = pending[len(replies) :]
            if not pending:
                return results
            replies = self._run(pending)

    def run_script(self, messages: Sequence[rq_message.RQMessage]) -> list[Any]:
        """The batch's one script call (rq_script.SCRIPT); its replies, one per job until the
        first refused. A Redis that does not know the script (restarted, failed over) is given it."""
        link = self._open_link()
        packed = rq_script.command(messages)
        try:
            return list(link.call_packed(packed, "EVALSHA"))
        except redis.exceptions.NoScriptError:
            link.client.script_load(rq_script.SCRIPT)  # type: ignore[no-untyped-call]
            return list(link.call_packed(packed, "EVALSHA"))

    def _result(
        self, job: models.StagedJob, message: rq_message.RQMessage, reply: Any
    ) -> models.PublishResult:
        """One job's result from its reply; raise BackendUnavailable for a refusal that is not
        the job's nor its queue's (the key the script names is the evidence)."""
        if isinstance(reply, list):  # (the key whose write Redis refused, the error): the script stopped
            key, error = (_decoded(part) for part in reply[:2])
            if key == _decoded(message.queue_key) and redis_errors.wrong_type(error):
                return models.PublishResult.retry(job, self._queue_refusal(key))
            raise redis_errors.unavailable(self._label, error, key)
        if reply in (rq_script.WRITTEN, rq_script.SKIPPED):
            return models.PublishResult.published(job)
        if reply == rq_script.HELD:
            return models.PublishResult.rejected(job, self._held_reason(job))
        if isinstance(reply, bytes):  # the queue's key holds another type: the queue's fault
            return models.PublishResult.retry(
                job, f"{self.name}: {_decoded(reply)}"[: backend.MAX_REASON_CHARS]
            )
        raise errors.BackendUnavailable(f"{self._label}: the script replied {type(reply).__name__}")

    def _queue_refusal(self, key: str) -> str:
        return f"{self.name}: the Redis key {key[:100]!r} is not an RQ queue list"[: backend.MAX_REASON_CHARS]

    def _held_reason(self, job: models.StagedJob) -> str:
        return (
            f"{self.name}: RQ already holds a job with job_id {job.job_id} that this row did not "
            "create (e.g. a failed job kept for its failure_ttl, or one enqueued elsewhere); delete "
            "that RQ job or stage this one with a new job_id"
        )


def _decoded(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
