"""The RQ backend: each staged job becomes a real RQ job that a plain ``rq worker`` runs.

An RQ job is ``func=job_name`` (a dotted path the worker imports), the row's args and kwargs, and
``job_id`` = the row's job id. Each row is first turned into its Redis writes through
``drain.backend.build_each`` (``rq_rules`` checks the name and options as RQ and its worker would,
``rq_message`` computes the hash fields ``Queue.enqueue_many`` writes; no I/O): a row RQ would
refuse is that row's rejection, never a crash and never "backend unavailable".

Then the whole batch is one script call (``rq_script``), one round trip: per job it skips the
duplicate a crash between Redis's reply and the database commit leaves (the job hash carries
this row's mark), rejects a row whose job id RQ holds for something else (a failed job kept for
its failure_ttl, a job enqueued elsewhere) or whose queue key is not a list, and writes the rest.
The reply is the acknowledgement. Only connection-level failures and a server that refuses all
writes (OOM, READONLY, MISCONF, ...) raise BackendUnavailable.
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
from drain_adapters import rq_message, rq_rules, rq_script

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


@contextlib.contextmanager
def _translate(name: str) -> Iterator[None]:
    """Turn redis-py's connection-level failures, and a server refusing the whole call (OOM,
    READONLY, MISCONF, BUSY: per-job refusals are replies of the script, never errors), into
    BackendUnavailable (no URL, no secret)."""
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
        self._script: Any = None
        self._names: dict[str, str | None] = {}  # job_name -> refusal reason (None = allowed)
        if settings.allowed_jobs is None:
            log.warning(
                "backend %s: no allowed_jobs; any row can make the RQ workers import and run any "
                'function of any module (set allowed_jobs = ["app.tasks.*"])',
                name,
                extra={"event": "no_allowed_jobs", "backend": name},
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
        self._script = self._redis.register_script(rq_script.SCRIPT)
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
        keys, argv = rq_script.arguments([message for _, message in built])
        with _translate(self.name):
            replies = self._script(keys=keys, args=argv, client=client)
        for (job, _), reply in zip(built, replies, strict=True):
            if reply in (rq_script.WRITTEN, rq_script.SKIPPED):
                results.append(models.PublishResult.published(job))
            elif reply == rq_script.HELD:
                results.append(models.PublishResult.rejected(job, self._held_reason(job)))
            else:
                text = reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
                results.append(
                    models.PublishResult.rejected(job, f"{self.name}: {text}"[: backend.MAX_REASON_CHARS])
                )
        return results

    def _held_reason(self, job: models.StagedJob) -> str:
        return (
            f"{self.name}: RQ already holds a job with job_id {job.job_id} that this row did not "
            "create (e.g. a failed job kept for its failure_ttl, or one enqueued elsewhere); delete "
            "that RQ job or stage this one with a new job_id"
        )
