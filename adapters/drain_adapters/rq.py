"""The RQ backend: each staged job becomes a real RQ job that a plain ``rq worker`` runs.

An RQ job is ``func=job_name`` (a dotted path the worker imports), the row's args and kwargs, and
``job_id`` = the row's job id. A batch goes to Redis in one transactional pipeline (MULTI/EXEC), so
its reply is the acknowledgement. Before pushing, ids that RQ already holds are skipped: that is the
duplicate a crash between the Redis reply and the database commit would otherwise cause (the
window lasts as long as RQ keeps the job hash: its result_ttl / failure_ttl).

An RQ worker imports whatever path it is given, so ``allowed_jobs`` (glob patterns) limits what a
row may name; a job outside them is REJECTED with the reason and never reaches Redis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import redis
import rq
from rq import job as rq_job
from rq import serializers

from drain import errors, models, options

log = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
# None is RQ's own default (pickle), and skips a Protocol isinstance check per job.
SERIALIZERS: dict[str, Any] = {"pickle": None, "json": serializers.JSONSerializer}
INT_OPTIONS = ("timeout", "result_ttl", "ttl", "failure_ttl")
KNOWN_OPTIONS = (*INT_OPTIONS, "retry", "meta", "description", "at_front")
EXISTS_EACH = """
local held = {}
for i, key in ipairs(KEYS) do held[i] = redis.call('EXISTS', key) end
return held
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
        problems = reader.finish()
        if problems:
            raise errors.ConfigError(problems)
        return settings


@contextlib.contextmanager
def _translate(name: str) -> Iterator[None]:
    """Turn redis-py's connection-level failures into BackendUnavailable (no URL, no secret)."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError) as exc:
        raise errors.BackendUnavailable(f"redis backend {name}: {type(exc).__name__}: {exc}") from None
    except redis.ResponseError as exc:
        # OOM, READONLY replica, MISCONF (failed RDB save): the server refuses all writes.
        raise errors.BackendUnavailable(f"redis backend {name} refused the write: {exc}") from None


class RQAdapter:
    """Enqueue staged jobs as RQ jobs."""

    def __init__(self, name: str, settings: RQSettings) -> None:
        self.name = name
        self.settings = settings
        self._redis: redis.Redis[bytes] | None = None
        self._queues: dict[str, rq.Queue] = {}
        self._serializer = SERIALIZERS[settings.serializer]
        self._exists_script: Any = None
        if settings.allowed_jobs is None:
            log.warning(
                "backend %s: no allowed_jobs; any row can make the RQ workers import and run any "
                'function (set allowed_jobs = ["app.tasks.*"])',
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
        self._queues = {}
        self._exists_script = self._redis.register_script(EXISTS_EACH)
        self.ping()

    def ping(self) -> None:
        with _translate(self.name):
            self._client().ping()

    def close(self) -> None:
        client, self._redis = self._redis, None
        self._queues = {}
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def _client(self) -> redis.Redis[bytes]:
        if self._redis is None:
            raise errors.BackendUnavailable(f"redis backend {self.name} is not open")
        return self._redis

    def _queue(self, name: str) -> rq.Queue:
        queue = self._queues.get(name)
        if queue is None:
            queue = rq.Queue(name, connection=self._client(), serializer=self._serializer)
            self._queues[name] = queue
        return queue

    def _refusal(self, job: models.StagedJob) -> str | None:
        allowed = self.settings.allowed_jobs
        if allowed is not None and not any(fnmatch.fnmatchcase(job.job_name, p) for p in allowed):
            return f"job_name {job.job_name!r} is not in allowed_jobs of backend {self.name}"
        unknown = sorted(set(job.options) - set(KNOWN_OPTIONS))
        if unknown:
            return f"unknown RQ option(s) {', '.join(unknown)} (known: {', '.join(KNOWN_OPTIONS)})"
        for key in INT_OPTIONS:
            value = job.options.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                return f"RQ option {key} must be an integer number of seconds, not {value!r}"
        meta = job.options.get("meta")
        if meta is not None and not isinstance(meta, dict):
            return "RQ option meta must be an object"
        retry = job.options.get("retry")
        retry_ok = isinstance(retry, dict) and isinstance(retry.get("max"), int)
        if retry is not None and not (retry_ok and set(retry) <= {"max", "interval"}):
            return 'RQ option retry must be {"max": N, "interval": SECONDS or [SECONDS, ...]}'
        return None

    def _prepare(self, queue: rq.Queue, job: models.StagedJob) -> Any:
        opts = job.options
        retry = opts.get("retry")
        return queue.prepare_data(
            job.job_name,
            args=list(job.args),
            kwargs=dict(job.kwargs),
            timeout=opts.get("timeout"),
            result_ttl=opts.get("result_ttl"),
            ttl=opts.get("ttl"),
            failure_ttl=opts.get("failure_ttl"),
            description=opts.get("description"),
            job_id=str(job.job_id),
            at_front=bool(opts.get("at_front", False)),
            meta=opts.get("meta"),
            retry=rq.Retry(max=retry["max"], interval=retry.get("interval", 0)) if retry else None,
        )

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> list[models.PublishResult]:
        results: list[models.PublishResult] = []
        candidates: list[models.StagedJob] = []
        for job in jobs:
            refusal = self._refusal(job)
            if refusal is None:
                candidates.append(job)
            else:
                results.append(models.PublishResult.rejected(job, refusal))
        if not candidates:
            return results
        client = self._client()
        with _translate(self.name):
            # One command for the whole batch, not one EXISTS per job: redis-py's packing is
            # the client's main cost on this path.
            keys = [rq_job.Job.key_for(str(job.job_id)) for job in candidates]
            held = self._exists_script(keys=keys, client=client)
            fresh = [job for job, exists in zip(candidates, held, strict=True) if not exists]
            results.extend(
                models.PublishResult.published(job)
                for job, exists in zip(candidates, held, strict=True)
                if exists
            )
            if not fresh:
                return results
            by_queue: dict[str, list[models.StagedJob]] = {}
            for job in fresh:
                by_queue.setdefault(job.queue, []).append(job)
            pipe = client.pipeline()
            refused: list[models.PublishResult] = []
            for queue_name, group in by_queue.items():
                queue = self._queue(queue_name)
                datas = []
                for job in group:
                    try:
                        datas.append(self._prepare(queue, job))
                    except (TypeError, ValueError) as exc:
                        refused.append(models.PublishResult.rejected(job, f"RQ refused the job: {exc}"))
                queue.enqueue_many(datas, pipeline=pipe)
            pipe.execute()
        refused_ids = {result.row_id for result in refused}
        results.extend(refused)
        results.extend(models.PublishResult.published(job) for job in fresh if job.id not in refused_ids)
        return results
