"""The RQ backend: each staged job becomes a real RQ job that a plain ``rq worker`` runs.

An RQ job is ``func=job_name`` (a dotted path the worker imports), the row's args and kwargs, and
``job_id`` = the row's job id. A batch costs two Redis round trips:

1. one script call checks, for every job id of the batch, whether RQ already holds it, and
   whether the holder is *this row's own earlier forward* (the job hash carries the row's mark,
   ``rq_message.MARK_FIELD``) — that is the duplicate a crash between Redis's reply and the
   database commit leaves, and it is skipped as published. Any other holder (a failed job kept
   for its ``failure_ttl``, a job enqueued by someone else) gets the row REJECTED with the
   reason. The same call reads the type of each queue key, so a key that is not RQ's list
   rejects its rows instead of failing inside the transaction;
2. one MULTI/EXEC pipeline writes every job of the batch (``rq_message``: the keys and fields
   ``Queue.enqueue_many`` writes); its reply is the acknowledgement.

Each row is turned into its writes through ``drain.backend.build_each`` first (``rq_rules``
validates the name and options; no I/O): a row RQ would refuse is that row's rejection, never a
crash and never "backend unavailable". A reply in the EXEC that refuses one job's command rejects
that job (and its partial writes are removed); only connection-level failures and a server that
refuses all writes (OOM, READONLY, MISCONF, ...) raise BackendUnavailable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import redis
from rq import serializers

from drain import allowlist, backend, errors, models, options
from drain_adapters import rq_message, rq_rules

log = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
SERIALIZERS: dict[str, rq_message.Serializer] = {
    "pickle": serializers.DefaultSerializer.dumps,
    "json": serializers.JSONSerializer.dumps,
}
# Replies meaning the server refuses every write right now, not this one job.
# (redis-py strips the error code from the classes it maps, e.g. OOM; the others keep it.)
SERVER_REFUSALS: tuple[type[Exception], ...] = (
    getattr(redis.exceptions, "OutOfMemoryError", redis.exceptions.ReadOnlyError),
    redis.exceptions.ReadOnlyError,
    redis.exceptions.NoPermissionError,
    redis.exceptions.ExecAbortError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
)
SERVER_REFUSAL_PREFIXES = ("MISCONF", "NOREPLICAS", "BUSY", "LOADING", "OOM", "READONLY", "MASTERDOWN")
QUEUE_TYPES_OK = ("none", "list")
MAX_REMEMBERED_NAMES = 4096  # job names whose check is remembered (the set is cleared when full)
MAX_REMEMBERED_NAME_CHARS = 512
ABSENT, OURS, OTHER = 0, 1, 2
# KEYS = job hashes (n), then queue keys; ARGV = n, the mark field, then one mark per job hash.
# Per job: 0 absent, 1 held with this row's mark, 2 held by something else; per queue: its type.
CHECK_SCRIPT = """
local n = tonumber(ARGV[1])
local out = {}
for i = 1, n do
  local mark = redis.pcall('HGET', KEYS[i], ARGV[2])
  if mark == ARGV[i + 2] then
    out[i] = 1
  elseif redis.call('EXISTS', KEYS[i]) == 1 then
    out[i] = 2
  else
    out[i] = 0
  end
end
for i = n + 1, #KEYS do
  out[i] = redis.call('TYPE', KEYS[i])['ok']
end
return out
"""


@dataclasses.dataclass(frozen=True)
class RQSettings:
    """``[backends.<name>]`` with ``type = "rq"``."""

    url: str = dataclasses.field(default=DEFAULT_URL, repr=False)
    allowed_jobs: tuple[str, ...] | None = None
    serializer: str = "pickle"
    socket_timeout_s: float = 5.0

    @classmethod
    def parse(cls, name: str, values: Mapping[str, Any], publish_timeout_s: float) -> RQSettings:
        reader = options.OptionReader(values, f"backends.{name}.")
        settings = cls(
            url=reader.string("url", DEFAULT_URL) or DEFAULT_URL,
            allowed_jobs=reader.strings("allowed_jobs"),
            serializer=reader.string("serializer", "pickle") or "pickle",
            socket_timeout_s=reader.number("socket_timeout_s", min(5.0, publish_timeout_s), minimum=0.1),
        )
        if settings.serializer not in SERIALIZERS:
            reader.problem("serializer", f"must be one of {', '.join(SERIALIZERS)}")
        if not settings.url.startswith(("redis://", "rediss://", "unix://")):
            reader.problem("url", "must be a redis://, rediss:// or unix:// URL")
        if settings.allowed_jobs is not None:
            for problem in allowlist.Allowlist.parse(settings.allowed_jobs, allow_double_star=False)[1]:
                reader.problem("allowed_jobs", problem)
        problems = reader.finish()
        if problems:
            raise errors.ConfigError(problems)
        return settings


def _server_refuses(exc: Exception) -> bool:
    return isinstance(exc, SERVER_REFUSALS) or str(exc).startswith(SERVER_REFUSAL_PREFIXES)


@contextlib.contextmanager
def _translate(name: str) -> Iterator[None]:
    """Turn redis-py's connection-level failures, and a server refusing every write, into
    BackendUnavailable (no URL, no secret). Other replies are handled per job by the caller."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise errors.BackendUnavailable(f"redis backend {name}: {type(exc).__name__}: {exc}") from None
    except redis.ResponseError as exc:
        raise errors.BackendUnavailable(f"redis backend {name} refused the write: {exc}") from None


class RQAdapter:
    """Enqueue staged jobs as RQ jobs."""

    def __init__(self, name: str, settings: RQSettings) -> None:
        self.name = name
        self.settings = settings
        self._redis: redis.Redis[bytes] | None = None
        self._dumps = SERIALIZERS[settings.serializer]
        self._allowed: allowlist.Allowlist | None = None
        if settings.allowed_jobs is not None:
            self._allowed = allowlist.Allowlist.parse(settings.allowed_jobs, allow_double_star=False)[0]
        self._check_script: Any = None
        self._names: dict[str, str | None] = {}  # job_name -> refusal reason (None = allowed)
        if settings.allowed_jobs is None:
            log.warning(
                "backend %s: no allowed_jobs; any row can make the RQ workers import and run any "
                'function of any module (set allowed_jobs = ["app.tasks.*"])',
                name,
            )

    @classmethod
    def from_options(cls, name: str, options_: Mapping[str, Any], *, publish_timeout_s: float) -> RQAdapter:
        return cls(name, RQSettings.parse(name, options_, publish_timeout_s))

    def open(self) -> None:
        timeout = self.settings.socket_timeout_s
        self._redis = redis.Redis.from_url(
            self.settings.url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            health_check_interval=30,
        )
        self._check_script = self._redis.register_script(CHECK_SCRIPT)
        self.ping()

    def ping(self) -> None:
        with _translate(self.name):
            self._client().ping()

    def close(self) -> None:
        client, self._redis = self._redis, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def _client(self) -> redis.Redis[bytes]:
        if self._redis is None:
            raise errors.BackendUnavailable(f"redis backend {self.name} is not open")
        return self._redis

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
        now = rq_message.timestamp()
        built, results = backend.build_each(jobs, lambda job: self.build(job, now), self.name)
        if not built:
            return results
        client = self._client()
        with _translate(self.name):
            fresh = self._check(client, built, results)
            if fresh:
                self._write(client, fresh, results)
        return results

    def _check(
        self,
        client: redis.Redis[bytes],
        built: list[tuple[models.StagedJob, rq_message.RQMessage]],
        results: list[models.PublishResult],
    ) -> list[tuple[models.StagedJob, rq_message.RQMessage]]:
        """Sort out the jobs RQ already holds and the queues that are not lists; return the rest."""
        queue_keys = list(dict.fromkeys(message.queue_key for _, message in built))
        keys = [message.job_key for _, message in built] + queue_keys
        argv = [len(built), rq_message.MARK_FIELD, *(message.mark for _, message in built)]
        reply = self._check_script(keys=keys, args=argv, client=client)
        held, types = reply[: len(built)], reply[len(built) :]
        bad_queues = {
            key: kind.decode() if isinstance(kind, bytes) else str(kind)
            for key, kind in zip(queue_keys, types, strict=True)
            if (kind.decode() if isinstance(kind, bytes) else str(kind)) not in QUEUE_TYPES_OK
        }
        fresh = []
        for (job, message), state in zip(built, held, strict=True):
            if state == OURS:
                results.append(models.PublishResult.published(job))
            elif state == OTHER:
                results.append(models.PublishResult.rejected(job, self._held_reason(job)))
            elif message.queue_key in bad_queues:
                reason = (
                    f"{self.name}: Redis key {message.queue_key.decode(errors='replace')!r} is a "
                    f"{bad_queues[message.queue_key]}, not an RQ queue list"
                )
                results.append(models.PublishResult.rejected(job, reason[: backend.MAX_REASON_CHARS]))
            else:
                fresh.append((job, message))
        return fresh

    def _held_reason(self, job: models.StagedJob) -> str:
        return (
            f"{self.name}: RQ already holds a job with job_id {job.job_id} that this row did not "
            "create (e.g. a failed job kept for its failure_ttl, or one enqueued elsewhere); delete "
            "that RQ job or stage this one with a new job_id"
        )

    def _write(
        self,
        client: redis.Redis[bytes],
        fresh: list[tuple[models.StagedJob, rq_message.RQMessage]],
        results: list[models.PublishResult],
    ) -> None:
        """One MULTI/EXEC for the batch; a command refused for one job rejects (and undoes) that job."""
        pipe = client.pipeline(transaction=True)
        owners: list[list[int]] = []  # per command: the indexes (in fresh) of the jobs it serves
        by_queue: dict[bytes, list[int]] = {}
        for index, (_, message) in enumerate(fresh):
            by_queue.setdefault(message.queue_key, []).append(index)
        for queue_key, members in by_queue.items():
            pipe.sadd(rq_message.QUEUES_KEY, queue_key)
            owners.append(members)
            for index in members:
                message = fresh[index][1]
                pipe.hset(message.job_key, mapping=message.fields)  # type: ignore[arg-type]
                owners.append([index])
                if message.ttl:
                    pipe.expire(message.job_key, message.ttl)
                    owners.append([index])
                if message.at_front:
                    pipe.lpush(queue_key, message.job_id)
                else:
                    pipe.rpush(queue_key, message.job_id)
                owners.append([index])
        replies = pipe.execute(raise_on_error=False)
        refused: dict[int, str] = {}
        for reply, served in zip(replies, owners, strict=True):
            if isinstance(reply, Exception):
                if _server_refuses(reply):
                    raise redis.ResponseError(str(reply))
                for index in served:
                    refused.setdefault(index, errors.first_line(reply))
        for index, (job, _) in enumerate(fresh):
            if index in refused:
                reason = f"{self.name}: Redis refused the job: {refused[index]}"
                results.append(models.PublishResult.rejected(job, reason[: backend.MAX_REASON_CHARS]))
            else:
                results.append(models.PublishResult.published(job))
        if refused:
            self._undo(client, [fresh[index][1] for index in refused])

    def _undo(self, client: redis.Redis[bytes], messages: list[rq_message.RQMessage]) -> None:
        """Remove what a refused job's other commands wrote, so its retry starts clean (its mark
        must not make the retry look like this row's own earlier forward)."""
        pipe = client.pipeline(transaction=True)
        for message in messages:
            pipe.delete(message.job_key)
            pipe.lrem(message.queue_key, 0, message.job_id)
        pipe.execute(raise_on_error=False)
