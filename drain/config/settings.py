"""The settings: typed, frozen dataclasses, their defaults and ranges, and every bound derived from them.

What a drain runs with, and nothing about where it came from: :mod:`drain.config.loading` builds a
:class:`Settings` from a file, ``DRAIN_*`` variables and flags (validated by
:mod:`drain.config.parsing`), and :mod:`drain.config.showing` prints it for
``drain check --show-config``. Each bound derived from several settings (the session's
idle-in-transaction fence, the longest healthy turn of the loop, the watchdog's bound, the age at
which ``/healthz`` calls the loop wedged) is written once, here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from drain import models
from drain.observability import redaction

DEFAULT_BATCH_SIZE = 500
MAX_BATCH_SIZE = 10_000
BATCH_MAX_BYTES = 48 << 20  # the rows' decoded weight a drain holds at once (drain.store.reading)
MIN_BATCH_MAX_BYTES = 1 << 20
MAX_BATCH_MAX_BYTES = 1 << 40
POLL_MIN_S = 0.01
POLL_MAX_S = 1.0
WAKEUP_POLL_MAX_S = 10.0  # the idle poll's cap while the wake-up is armed and trusted
MAX_WAKEUP_POLL_MAX_S = 30.0  # a loop that turns at least this often stays healthy (/healthz: 60 s at least)
STANDBY_RETRY_S = 2.0
PUBLISH_TIMEOUT_S = 10.0
MAX_ATTEMPTS = 10
RETRY_BASE_S = 1.0
PIPELINE_DEPTH = 4  # full batches that may await their broker acknowledgements at once
MAX_PIPELINE_DEPTH = 16
LANES = 1  # one drain leads the whole table (drain.relay.lanes: more)
MAX_LANES = 256
RETRY_MAX_S = 600.0
STATEMENT_TIMEOUT_S = 30.0
LOG_REPEAT_S = 10.0  # a warning's cause is written at most once per this many seconds
MAX_LOG_REPEAT_S = 3600.0
SETTLE_TIMEOUT_S = 300.0  # how long a drain may be unable to settle before `drain run` exits 6
STOP_TIMEOUT_S = 30.0  # from the first SIGTERM, how long `drain run` may take to stop (else exit 7)
MAX_STOP_TIMEOUT_S = 40.0  # below the shipped units' 45 s (TimeoutStopSec, terminationGracePeriodSeconds)
WATCHDOG_MIN_S = 60.0
WATCHDOG_FLOOR_S = 1.0  # an explicit watchdog_s below this would take a turn's own work for a stall
STALE_AFTER_MIN_S = 60.0  # /healthz never calls a loop wedged sooner
DEFAULT_METRICS_HOST = "127.0.0.1"
CATCH_UP_MODES = ("all", "latest", "none")
DEFAULT_CATCH_UP = "latest"
CATCH_UP_MAX = 100  # ticks one schedule may stage at once after an outage (catch_up = "all")
MAX_CATCH_UP_MAX = 1000
MAX_SCHEDULE_NAME_CHARS = 200
MAX_SCHEDULE_PAYLOAD_BYTES = 1 << 20
MAX_POLL_S = 300.0  # poll_min_s, poll_max_s: an idle poll at most every five minutes
MAX_STANDBY_RETRY_S = 300.0
MAX_PUBLISH_TIMEOUT_S = 600.0  # idle_in_transaction_session_timeout is then 30 minutes
MAX_STATEMENT_TIMEOUT_S = 3600.0
MAX_SETTLE_TIMEOUT_S = 7 * 86400.0
MAX_WATCHDOG_S = 86400.0
MAX_RETRY_S = 30 * 86400.0  # retry_base_s, retry_max_s: a retried row's run_at stays far from 9999
MAX_MAX_ATTEMPTS = 1_000_000  # attempts is an integer column
WAKEUP_NOTIFY = "notify"  # an idle leader is woken by a producer's commit (drain.relay.wakeup)
WAKEUP_POLL = "poll"  # it only polls (poll_min_s .. poll_max_s)
WAKEUP_MODES = (WAKEUP_NOTIFY, WAKEUP_POLL)

LIMITS: Mapping[str, tuple[float, float]] = {
    "batch_size": (1, MAX_BATCH_SIZE),
    "batch_max_bytes": (MIN_BATCH_MAX_BYTES, MAX_BATCH_MAX_BYTES),
    "poll_min_s": (0.001, MAX_POLL_S),
    "poll_max_s": (0.001, MAX_POLL_S),
    "wakeup_poll_max_s": (0.001, MAX_WAKEUP_POLL_MAX_S),
    "standby_retry_s": (0.01, MAX_STANDBY_RETRY_S),
    "publish_timeout_s": (0.1, MAX_PUBLISH_TIMEOUT_S),
    "max_attempts": (1, MAX_MAX_ATTEMPTS),
    "pipeline_depth": (0, MAX_PIPELINE_DEPTH),
    "lanes": (1, MAX_LANES),
    "retry_base_s": (0.0, MAX_RETRY_S),
    "retry_max_s": (0.0, MAX_RETRY_S),
    "statement_timeout_s": (0.1, MAX_STATEMENT_TIMEOUT_S),
    "log_repeat_s": (0.0, MAX_LOG_REPEAT_S),
    "settle_timeout_s": (1.0, MAX_SETTLE_TIMEOUT_S),
    "stop_timeout_s": (1.0, MAX_STOP_TIMEOUT_S),
    "watchdog_s": (0.0, MAX_WATCHDOG_S),
}
"""Every numeric top-level key's allowed range (``max_attempts`` also bounds a backend's): a
value outside it is refused at load with one line naming the key and the range. The upper
bounds keep what is derived from a value in range: sleeps and timers, the session's timeouts in
PostgreSQL's integer milliseconds, a retried row's ``run_at`` (the table refuses 9999 and later)."""


@dataclasses.dataclass(frozen=True)
class BackendSettings:
    """One ``[backends.<name>]`` section: the core's keys, and the rest for the adapter."""

    name: str
    type: str
    max_attempts: int
    options: Mapping[str, Any] = dataclasses.field(repr=False)
    block_on_dead_letter: bool = False
    """A keyed row of this backend waits while a dead letter of its ordering key exists (until
    `drain dead retry` or `purge`); by default the rows after a dead letter go on."""


@dataclasses.dataclass(frozen=True)
class ScheduleSettings:
    """One ``[[schedules]]`` entry: stage ``job_name`` on every tick of ``cron`` in ``timezone``.

    ``catch_up`` says what a leader stages for the ticks that fell due while no drain was
    leading: ``all`` (the ``catch_up_max`` most recent of them), ``latest`` (one) or ``none``.
    """

    name: str
    """Unique; the key of its history row in `<table>_schedules`."""
    cron: str
    """5 fields, or 6 with a leading seconds field (`*/10 * * * * *`)."""
    job_name: str
    """The job each tick stages, as a staged row's `job_name`."""
    args: tuple[Any, ...] = ()
    """The job's positional arguments, like a staged row's `job_args`."""
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The job's keyword arguments, like a staged row's `job_kwargs`."""
    queue: str = "default"
    """The queue, as on a staged row."""
    backend: str = "default"
    """Must be a configured backend."""
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The backend's options, as on a staged row."""
    timezone: str = "UTC"
    """An IANA name: the cron expression is read in this zone."""
    catch_up: str = DEFAULT_CATCH_UP
    """`all`, `latest` or `none`: what a leader stages for the ticks missed while none led."""
    catch_up_max: int = CATCH_UP_MAX
    """With `catch_up = "all"`: at most this many missed ticks."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the drain needs to run; build it with :func:`drain.config.loading.load`."""

    # Each key's docstring is its meaning in the configuration reference of the docs, generated
    # from these fields, their defaults and LIMITS (scripts/config_reference.py): Markdown, with
    # links relative to the docs' root; the range is LIMITS' and is not repeated here.
    dsn: str = dataclasses.field(default="", repr=False)
    """The database URL (also `--dsn`, `DRAIN_DSN`, `DATABASE_URL`, then libpq's `PG*` variables:
    [Configuration](configuration.md))."""
    schema: str = models.DEFAULT_SCHEMA
    """The schema the table lives in. Letters, digits and underscores."""
    table: str = models.DEFAULT_TABLE
    """Where the table lives (dead letters: `<table>_dead`). Letters, digits and underscores; every
    name drain derives from the table's (`<table>_dead_dead_id_idx` is the longest) must fit
    PostgreSQL's 63 bytes, so a table name has at most 46, else the config is refused with one line
    naming the key."""
    batch_size: int = DEFAULT_BATCH_SIZE
    """Rows per batch."""
    batch_max_bytes: int = BATCH_MAX_BYTES
    """The most the jobs being read and in flight may take in the drain's memory, estimated before
    decoding (drain.store.reading); a row over a quarter of it as text, or heavier than all of it, is
    dead-lettered unread. See [Memory](operations/sizing.md#memory)."""
    poll_min_s: float = POLL_MIN_S
    """Idle polling backs off from `poll_min_s` to `poll_max_s`; a full batch is followed at once
    by the next, a partial one of two rows or more after `poll_min_s` (at most 10 ms)."""
    poll_max_s: float = POLL_MAX_S
    """The idle poll's cap (at least `poll_min_s`); see `poll_min_s`."""
    wakeup: str = WAKEUP_NOTIFY
    """`notify`: a producer's commit wakes the idle leader within milliseconds and the poll is the
    safety net; `poll`: the poll only. See [Latency](latency.md)."""
    wakeup_poll_max_s: float = WAKEUP_POLL_MAX_S
    """While the wake-up is armed, the safety-net poll backs off up to this (at least
    `poll_max_s`); back to `poll_max_s` for ten minutes after a missed notification."""
    standby_retry_s: float = STANDBY_RETRY_S
    """How often a standby tries the lock (jittered to 0.75–1.5×)."""
    publish_timeout_s: float = PUBLISH_TIMEOUT_S
    """The bound on each backend call, counted from when a batch was sent (so one step waits at
    most this long for a backend's confirms however many batches are in flight, and a backend that
    failed is not called again in that step); a step calls no further backend once half of it has
    passed (their rows wait for the next step; the least recently called go first); a
    backend's own timeouts (`publish_timeout_s`, `connect_timeout_s`, `socket_timeout_s`) may not
    exceed it; the session's `idle_in_transaction_session_timeout` is set to max(3×, +10 s) of
    it."""
    max_attempts: int = MAX_ATTEMPTS
    """Rejections before a row is dead-lettered (per backend too: `[backends.NAME] max_attempts`)."""
    pipeline_depth: int = PIPELINE_DEPTH
    """Batches a pipelined backend (RabbitMQ, Celery on RabbitMQ) may have awaiting broker confirms
    while the next ones are read and published (0 = one whole batch per transaction). See [the
    drain process](drain-process.md)."""
    lanes: int = LANES
    """How many lanes the table's rows fall into, each led by one drain at a time: with more than one,
    several drains forward the table, each its share of the lanes. Every drain of a table runs with
    the same count. See [scaling](operations/scaling.md)."""
    retry_base_s: float = RETRY_BASE_S
    """Backoff after a rejection: `retry_base_s` × 2^(attempts−1), capped at `retry_max_s`, times a
    random 0.5–1."""
    retry_max_s: float = RETRY_MAX_S
    """The cap of the backoff after a rejection; see `retry_base_s`."""
    statement_timeout_s: float = STATEMENT_TIMEOUT_S
    """The session's `statement_timeout`."""
    settle_timeout_s: float = SETTLE_TIMEOUT_S
    """How long `drain run` may be unable to settle (delete what it published, or lead where it is
    connected: read-only, missing privileges, a DELETE that fails) before it exits with status 6; a
    standby server, and a table older than the drain (until `drain migrate`), are waited on without
    a bound. See [High availability](operations/high-availability.md)."""
    stop_timeout_s: float = STOP_TIMEOUT_S
    """From the first SIGTERM or SIGINT, how long `drain run` may take to stop: finish the step,
    settle what is in flight, release the lock, close its connections. Past it (a database or
    broker that stopped answering) the process exits with status 7 at once, without waiting on a
    socket: the open transaction never committed, so its rows stay staged and go again. At most
    40 s, below the 45 s the shipped systemd unit and Kubernetes manifest give before SIGKILL. See
    [Stopping](drain-process.md#stopping)."""
    watchdog_s: float | None = None
    """How long a turn of the loop may go without progress before the process exits (status 1,
    every thread's stack on stderr); the waits between turns (idle poll, wake-up, standby,
    backoffs) are not counted, so keep it above a turn's own (`publish_timeout_s`, 5 s to
    connect); 0 or absent: derived, twice the longest healthy turn (statement
    timeout + idle-in-transaction timeout + polls), at least 60 s (`watchdog_bound_s`); else at
    least 1."""
    log_level: str = "INFO"
    """`DEBUG`, `INFO`, `WARNING` or `ERROR`."""
    log_format: str = "text"
    """`text` or `json` (one JSON object per line on stderr,
    drain.observability.logs); also `--log-format` and `DRAIN_LOG_FORMAT`. See [Logs](logs.md)."""
    log_repeat_s: float = LOG_REPEAT_S
    """A warning of one cause (the same message from the same place, backend, queue and reason)
    is written at most once per this many seconds; the next line says how many were left out.
    0 writes every one. See [Logs](logs.md)."""
    metrics_listen: str | None = None
    """`[metrics] listen`: `HOST:PORT` (or `:PORT` for 127.0.0.1) for `/metrics`, `/healthz`,
    `/readyz`. See [Metrics and alerts](operations/metrics.md)."""
    backends: Mapping[str, BackendSettings] = dataclasses.field(default_factory=dict)
    """`[backends.NAME]`: `type` (`rq`, `rabbitmq`, `celery`, `dramatiq`, `nats`, `memory`), `max_attempts`,
    `block_on_dead_letter` (default false: a dead letter with an ordering key holds the later rows
    of its key until `drain dead retry` or `purge`; see [Per-key order](guarantees.md#per-key-order)),
    and the backend's own keys ([RQ](backends/rq.md), [RabbitMQ](backends/rabbitmq.md),
    [Celery](backends/celery.md), [Dramatiq](backends/dramatiq.md),
    [NATS JetStream](backends/nats.md))."""
    schedules: tuple[ScheduleSettings, ...] = ()
    """`[[schedules]]`: periodic jobs ([Delayed and periodic jobs](scheduling.md))."""
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """Where each value set by other than its default came from, by dotted key (``batch_size``,
    ``metrics.listen``, ``backends.default.url``, ``schedules``): ``file`` (``file ${NAME}`` when the
    value takes a variable), ``env DRAIN_...`` or ``flag --...``. Filled by :func:`drain.config.loading.load`;
    ``drain check --show-config`` prints it."""

    def __repr__(self) -> str:
        return redaction.redacted_repr(self, "dsn")

    @property
    def dead_table(self) -> str:
        return f"{self.table}_dead"

    def dead_blocking(self) -> list[str]:
        """The backends whose keyed rows wait while a dead letter of their key exists."""
        return sorted(name for name, section in self.backends.items() if section.block_on_dead_letter)

    def longest_turn_s(self) -> float:
        """The longest a healthy turn of the relay loop can take: a statement that runs to its
        timeout, then a publish that the session's idle-in-transaction fence would cut
        (:func:`batch_fence_s`), then the longest wait before the next turn (the idle poll, armed or
        not, and a standby's retry). Both bounds on a turn's age count from it."""
        waits = max(self.poll_max_s, self.wakeup_poll_max_s) + self.standby_retry_s
        return self.statement_timeout_s + batch_fence_s(self.publish_timeout_s) + waits

    def watchdog_bound_s(self) -> float:
        """How long the relay loop may go without progress before the process exits
        (drain.relay.watchdog): ``watchdog_s`` when set; otherwise twice the longest healthy turn,
        and never under WATCHDOG_MIN_S."""
        if self.watchdog_s is not None:
            return self.watchdog_s
        return max(WATCHDOG_MIN_S, 2 * self.longest_turn_s())

    def stale_after_s(self) -> float:
        """How old the loop's last turn may be before ``/healthz`` calls it wedged
        (drain.observability.server): the longest healthy turn, and never under STALE_AFTER_MIN_S."""
        return max(STALE_AFTER_MIN_S, self.longest_turn_s())


def batch_fence_s(publish_timeout_s: float) -> float:
    """The session's ``idle_in_transaction_session_timeout``: max(3×, +10 s) of the publish
    timeout, well above any wait of a step (drain.store.session sets it; the longest turn counts it)."""
    return max(3 * publish_timeout_s, publish_timeout_s + 10.0)
