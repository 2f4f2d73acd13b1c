"""Settings: a TOML file, ``DRAIN_*`` environment variables and command-line flags.

Precedence, highest first: flag > ``DRAIN_*`` variable > file > default. The database URL comes from
``--dsn``, ``DRAIN_DSN``, the file, ``DATABASE_URL``, then libpq's own ``PG*`` variables. String values
in the file may say ``${NAME}`` to take a secret from the environment. Nothing here reads the
environment by itself: callers pass it in.

Every key has a variable: ``DRAIN_<KEY>`` for a top-level key, ``DRAIN_<SECTION>__<KEY>`` for a key
of a table (``DRAIN_METRICS__LISTEN``), ``DRAIN_BACKENDS__<NAME>__<KEY>`` for a backend's key, and
``DRAIN_SCHEDULES`` for the whole ``[[schedules]]`` array. A variable's text is read as a TOML value
when it is one (``500``, ``true``, ``["a", "b"]``, ``{ max = 3 }``), and as the text itself
otherwise; a string key takes the text as it is (or unquoted, when it is a TOML string). Settings
remember where each value came from (``Settings.sources``) for ``drain check --show-config``.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import json
import re
import tomllib
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from drain import backend, errors, models
from drain.backend import options
from drain.observability import logs
from drain.relay import cron
from drain.staging import rows as staging_rows
from drain.store import sql

DEFAULT_TABLE = models.DEFAULT_TABLE
DEFAULT_SCHEMA = models.DEFAULT_SCHEMA
DEFAULT_BATCH_SIZE = 500
MAX_BATCH_SIZE = 10_000
BATCH_MAX_BYTES = 48 << 20  # the rows' decoded weight a drain holds at once (drain.store.reading)
MIN_BATCH_MAX_BYTES = 1 << 20
MAX_BATCH_MAX_BYTES = 1 << 40
POLL_MIN_S = 0.01
POLL_MAX_S = 1.0
WAKEUP_POLL_MAX_S = 10.0  # the idle poll's cap while the wake-up is armed and trusted
MAX_WAKEUP_POLL_MAX_S = 30.0  # a loop that turns at least this often stays healthy (/healthz: 60 s)
STANDBY_RETRY_S = 2.0
PUBLISH_TIMEOUT_S = 10.0
MAX_ATTEMPTS = 10
RETRY_BASE_S = 1.0
PIPELINE_DEPTH = 4  # full batches that may await their broker acknowledgements at once
MAX_PIPELINE_DEPTH = 16
RETRY_MAX_S = 600.0
STATEMENT_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 300.0  # how long a drain may be unable to settle before `drain run` exits 6
WATCHDOG_MIN_S = 60.0
WATCHDOG_FLOOR_S = 1.0  # an explicit watchdog_s below this would kill a healthy idle loop
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
    "retry_base_s": (0.0, MAX_RETRY_S),
    "retry_max_s": (0.0, MAX_RETRY_S),
    "statement_timeout_s": (0.1, MAX_STATEMENT_TIMEOUT_S),
    "settle_timeout_s": (1.0, MAX_SETTLE_TIMEOUT_S),
    "watchdog_s": (0.0, MAX_WATCHDOG_S),
}
"""Every numeric top-level key's allowed range (``max_attempts`` also bounds a backend's): a
value outside it is refused at load with one line naming the key and the range. The upper
bounds keep what is derived from a value in range: sleeps and timers, the session's timeouts in
PostgreSQL's integer milliseconds, a retried row's ``run_at`` (the table refuses 9999 and later)."""

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_PASSWORD_QUERY = re.compile(r"(password=)([^&#]*)", re.IGNORECASE)
_ENVIRONMENT_KEYS = {
    "DRAIN_DSN": "dsn",
    "DRAIN_SCHEMA": "schema",
    "DRAIN_TABLE": "table",
    "DRAIN_BATCH_SIZE": "batch_size",
    "DRAIN_PIPELINE_DEPTH": "pipeline_depth",
    "DRAIN_LOG_LEVEL": "log_level",
    "DRAIN_LOG_FORMAT": "log_format",
    "DRAIN_WATCHDOG_S": "watchdog_s",
    "DRAIN_WAKEUP": "wakeup",
}


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***`` (for logs, reprs and errors).

    Both the URL's own password (``scheme://user:secret@host``) and a ``password=`` parameter
    (libpq's ``host=db password=secret`` form, quoted or not, or a URL's query) are hidden, in
    each URL of a ``;``-separated list (Celery's failover ``broker_url``).
    """
    if "://" not in url:
        return logs.redact(url)  # libpq's key=value form
    several = url.split(";")
    if len(several) > 1 and all("://" in part for part in several):
        return ";".join(redact_url(part) for part in several)
    url = _PASSWORD_QUERY.sub(r"\1***", url)
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:  # an unparseable netloc (a bad port, a bracket): hide all of it
        return re.sub(r"://[^/?#]*@", "://***@", url)
    if password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = (parts.username or "") + ":***"
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}@{netloc[-1]}"))


def redacted_repr(settings: Any, url_field: str) -> str:
    """The dataclass repr of ``settings`` with the password in its ``url_field`` redacted."""
    fields = ", ".join(
        f"{field.name}={getattr(settings, field.name)!r}"
        for field in dataclasses.fields(settings)
        if field.name != url_field and field.repr
    )
    url = redact_url(getattr(settings, url_field))
    return f"{type(settings).__name__}({url_field}={url!r}, {fields})"


def normalize_dsn(dsn: str) -> str:
    """Accept SQLAlchemy-style ``postgresql+psycopg://`` URLs as libpq ones."""
    return re.sub(r"^postgres(?:ql)?\+[a-z0-9_]+://", "postgresql://", dsn)


@dataclasses.dataclass(frozen=True)
class BackendSettings:
    """One ``[backends.<name>]`` section: the core's keys, and the rest for the adapter."""

    name: str
    type: str
    max_attempts: int
    options: Mapping[str, Any] = dataclasses.field(repr=False)


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
    """Everything the drain needs to run; build it with :func:`load`."""

    # Each key's docstring is its meaning in the configuration reference of the docs, generated
    # from these fields, their defaults and LIMITS (scripts/config_reference.py): Markdown, with
    # links relative to the docs' root; the range is LIMITS' and is not repeated here.
    dsn: str = dataclasses.field(default="", repr=False)
    """The database URL (also `--dsn`, `DRAIN_DSN`, `DATABASE_URL`, then libpq's `PG*` variables:
    [Configuration](configuration.md))."""
    schema: str = DEFAULT_SCHEMA
    """The schema the table lives in. Letters, digits and underscores."""
    table: str = DEFAULT_TABLE
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
    by the next."""
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
    watchdog_s: float | None = None
    """How long the loop may go without progress before the process exits (status 1, every
    thread's stack on stderr); 0 or absent: derived, twice the longest healthy turn (statement
    timeout + idle-in-transaction timeout + polls), at least 60 s (`watchdog_bound_s`); else at
    least 1."""
    log_level: str = "INFO"
    """`DEBUG`, `INFO`, `WARNING` or `ERROR`."""
    log_format: str = "text"
    """`text` or `json` (one JSON object per line on stderr,
    drain.observability.logs); also `--log-format` and `DRAIN_LOG_FORMAT`. See [Logs](logs.md)."""
    metrics_listen: str | None = None
    """`[metrics] listen`: `HOST:PORT` (or `:PORT` for 127.0.0.1) for `/metrics`, `/healthz`,
    `/readyz`. See [Metrics and alerts](operations/metrics.md)."""
    backends: Mapping[str, BackendSettings] = dataclasses.field(default_factory=dict)
    """`[backends.NAME]`: `type` (`rq`, `rabbitmq`, `celery`, `memory`), `max_attempts`, and the
    backend's own keys ([RQ](backends/rq.md), [RabbitMQ](backends/rabbitmq.md),
    [Celery](backends/celery.md))."""
    schedules: tuple[ScheduleSettings, ...] = ()
    """`[[schedules]]`: periodic jobs ([Delayed and periodic jobs](scheduling.md))."""
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """Where each value set by other than its default came from, by dotted key (``batch_size``,
    ``metrics.listen``, ``backends.default.url``, ``schedules``): ``file`` (``file ${NAME}`` when the
    value takes a variable), ``env DRAIN_...`` or ``flag --...``. Filled by :func:`load`;
    ``drain check --show-config`` prints it."""

    def __repr__(self) -> str:
        return redacted_repr(self, "dsn")

    @property
    def dead_table(self) -> str:
        return f"{self.table}_dead"

    def watchdog_bound_s(self) -> float:
        """How long the relay loop may go without progress before the process exits.

        ``watchdog_s`` when set; otherwise twice the longest a healthy turn of the loop can take
        (a statement timeout, then a publish that the server's idle-in-transaction timeout would
        cut), and never under WATCHDOG_MIN_S.
        """
        if self.watchdog_s is not None:
            return self.watchdog_s
        idle_in_transaction_s = batch_fence_s(self.publish_timeout_s)
        waits = max(self.poll_max_s, self.wakeup_poll_max_s) + self.standby_retry_s
        longest_turn = self.statement_timeout_s + idle_in_transaction_s + waits
        return max(WATCHDOG_MIN_S, 2 * longest_turn)


def batch_fence_s(publish_timeout_s: float) -> float:
    """The session's ``idle_in_transaction_session_timeout``: max(3×, +10 s) of the publish
    timeout, well above any wait of a step (drain.store.session sets it; ``watchdog_bound_s`` counts it)."""
    return max(3 * publish_timeout_s, publish_timeout_s + 10.0)


def _substitute(value: Any, key: str, env: Mapping[str, str], problems: list[str]) -> Any:
    if isinstance(value, str):

        def replace(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in env:
                problems.append(f"{key}: environment variable {name} is not set")
                return ""
            return env[name]

        return _ENV_REFERENCE.sub(replace, value)
    if isinstance(value, dict):
        return {k: _substitute(v, f"{key}.{k}" if key else k, env, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(item, key, env, problems) for item in value]
    return value


def _read_file(path: str | Path, env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's data, and as written (before ``${NAME}`` substitution)."""
    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError:
        raise errors.ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise errors.ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except (ValueError, RecursionError) as exc:  # an integer past 4300 digits, arrays nested too deep
        raise errors.ConfigError(f"config file {path} is not valid TOML: {type(exc).__name__}") from None
    problems: list[str] = []
    data: dict[str, Any] = _substitute(raw, "", env, problems)
    if problems:
        raise errors.ConfigError(problems)
    return data, raw


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


# ---- The environment: DRAIN_<KEY>, DRAIN_<SECTION>__<KEY>, DRAIN_BACKENDS__<NAME>__<KEY> ----------

ENVIRONMENT_PREFIX = "DRAIN_"
SCHEDULES_VARIABLE = "DRAIN_SCHEDULES"
_SECTION_KEYS: Mapping[str, tuple[str, ...]] = {"metrics": ("listen",)}
_ALIASES: Mapping[str, tuple[str, str]] = {"DRAIN_METRICS_LISTEN": ("metrics", "listen")}
_NOT_SETTINGS = frozenset({"DRAIN_CONFIG", "DRAIN_FAILPOINTS", "DRAIN_EXTRAS"})
_NOT_SETTINGS_PREFIX = "DRAIN_TEST_"
# What Kubernetes puts in every pod for a Service named drain or drain-*: never a setting.
_SERVICE_LINK = re.compile(
    r"^DRAIN(?:_[A-Z0-9]+)*_(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9]+)*"
    r"|PORT(?:_[0-9]+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)?)$"
)
_NOT_TOP_LEVEL = frozenset({"backends", "schedules", "metrics_listen", "sources"})


def top_level_keys() -> tuple[str, ...]:
    """Every top-level key of the file, each settable as ``DRAIN_<KEY>``."""
    keys = [field.name for field in dataclasses.fields(Settings) if field.name not in _NOT_TOP_LEVEL]
    keys += [key for key in _ENVIRONMENT_KEYS.values() if key not in keys]
    return tuple(keys)


def _string_keys() -> frozenset[str]:
    """Top-level keys whose value is text: a variable's text is taken as is (no TOML reading)."""
    return frozenset(
        field.name
        for field in dataclasses.fields(Settings)
        if str(field.type).replace(" ", "") in ("str", "str|None")
    ) | {f"{section}.{key}" for section, keys in _SECTION_KEYS.items() for key in keys}


def environment_variable(key: str) -> str:
    """The variable that sets dotted ``key``: ``batch_size`` → ``DRAIN_BATCH_SIZE``,
    ``metrics.listen`` → ``DRAIN_METRICS__LISTEN``, ``backends.default.url`` →
    ``DRAIN_BACKENDS__DEFAULT__URL``."""
    return ENVIRONMENT_PREFIX + "__".join(part.upper() for part in key.split("."))


def environment_value(text: str, *, string: bool = False) -> Any:
    """A variable's text as the value it denotes.

    A TOML value (``10``, ``0.5``, ``true``, ``["a", "b"]``, ``{ max = 3 }``, ``"quoted"``) is read
    as one; any other text (``redis://h/0``, ``rq``, a date) is the string itself. With ``string``
    (a key whose value is text), only a quoted TOML string is read, so ``DRAIN_TABLE=true`` is the
    table ``true``.
    """
    try:
        parsed = tomllib.loads(f"value = {text}")
    except (tomllib.TOMLDecodeError, ValueError, RecursionError):
        return text
    value = parsed.get("value")
    if set(parsed) != {"value"} or isinstance(value, (datetime.date, datetime.time)):
        return text  # "1\nother = 2" is not one value; dates are no setting's type
    if string and not isinstance(value, str):
        return text
    return value


def _schedules_value(text: str) -> Any:
    """``DRAIN_SCHEDULES``: a TOML array of inline tables, or the same as JSON."""
    value = environment_value(text)
    if isinstance(value, str):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            return text  # reported by parse(): schedules must be an array of tables
    return value


def _known_variables() -> list[str]:
    names = [environment_variable(key) for key in top_level_keys()]
    names += [environment_variable(f"{s}.{k}") for s, keys in _SECTION_KEYS.items() for k in keys]
    return [*names, *_ALIASES, SCHEDULES_VARIABLE, "DRAIN_BACKENDS__<NAME>__<KEY>", *sorted(_NOT_SETTINGS)]


def _unknown(variable: str) -> str:
    guess = difflib.get_close_matches(variable, _known_variables(), n=1, cutoff=0.75)
    hint = f"did you mean {guess[0]}?" if guess else "see docs/reference/configuration.md"
    return f"{variable}: no setting has this variable ({hint}); unset it"


def _apply_environment(
    data: dict[str, Any], env: Mapping[str, str], referenced: set[str], sources: dict[str, str]
) -> list[str]:
    """Merge every ``DRAIN_*`` setting of ``env`` into ``data`` (the file's shape); return problems.

    An empty variable counts as unset. A ``DRAIN_*`` variable that sets nothing is a problem
    (a typo must not go unnoticed), unless drain reads it elsewhere (``DRAIN_CONFIG``,
    ``DRAIN_FAILPOINTS``), the file references it as ``${NAME}``, it is ``DRAIN_TEST_*``, or it is
    one of the variables Kubernetes defines for a Service named ``drain``.
    """
    problems: list[str] = []
    top = set(top_level_keys())
    strings = _string_keys()
    variables = sorted(name for name in env if name.startswith(ENVIRONMENT_PREFIX) and env[name])
    # the old spelling first, so that the canonical one wins when both are set
    variables.sort(key=lambda name: name not in _ALIASES)
    for variable in variables:
        text = env[variable]
        parts = variable[len(ENVIRONMENT_PREFIX) :].split("__")
        head = parts[0].lower()
        path: tuple[str, ...] | None = None
        if variable in _ALIASES:
            path = _ALIASES[variable]
        elif variable == SCHEDULES_VARIABLE:
            data["schedules"] = _schedules_value(text)
            sources["schedules"] = f"env {variable}"
            continue
        elif len(parts) == 1 and head in top:
            path = (head,)
        elif len(parts) == 2 and parts[1].lower() in _SECTION_KEYS.get(head, ()):
            path = (head, parts[1].lower())
        elif head == "backends":
            name, key = "__".join(parts[1:-1]).lower(), parts[-1].lower()
            if len(parts) < 3 or not name or not key:
                problems.append(f"{variable}: a backend's key is set by DRAIN_BACKENDS__<NAME>__<KEY>")
                continue
            found = data.get("backends")
            matches = [given for given in found if given.lower() == name] if isinstance(found, dict) else []
            if len(matches) > 1:
                problems.append(
                    f"{variable}: the file has backends {' and '.join(sorted(matches))}; rename one"
                )
                continue
            path = ("backends", matches[0] if matches else name, key)
        if path is None:
            if not (
                variable in _NOT_SETTINGS
                or variable in referenced
                or variable.startswith(_NOT_SETTINGS_PREFIX)
                or _SERVICE_LINK.match(variable)
            ):
                problems.append(_unknown(variable))
            continue
        dotted = ".".join(path)
        value = environment_value(text, string=dotted in strings)
        table = data
        for part in path[:-1]:
            inner = table.setdefault(part, {})
            if not isinstance(inner, dict):  # the file's own mistake, which parse() reports
                break
            table = inner
        else:
            table[path[-1]] = value
            sources[dotted] = f"env {variable}"
    return problems


def _file_sources(raw: Mapping[str, Any], prefix: str, sources: dict[str, str]) -> None:
    """``file``, or ``file ${NAME}`` for a value that takes a variable."""
    for key, value in raw.items():
        if isinstance(value, dict) and (prefix or key in _SECTION_KEYS or key == "backends"):
            _file_sources(value, f"{prefix}{key}.", sources)
        else:
            names = dict.fromkeys(name for text in _strings(value) for name in _ENV_REFERENCE.findall(text))
            sources[f"{prefix}{key}"] = " ".join(["file", *(f"${{{name}}}" for name in names)])


def _with_variables(problem: str, sources: Mapping[str, str]) -> str:
    """``problem`` (``key: message``), naming the variable that set the key or a key it mentions."""
    head = problem.split(": ", 1)[0]
    candidates = [head]
    candidates += [head[: match.start()] for match in re.finditer(r"[.\[]", head)]
    # a key missing from a section that only variables made (a backend without its type)
    parent = head.rpartition(".")[0]
    siblings = [key for key in sources if parent and key.startswith(f"{parent}.")]
    only_env = bool(siblings) and all(sources[key].startswith("env ") for key in siblings)
    named = [
        sources[key][len("env ") :]
        for key in sources
        if sources[key].startswith("env ")
        and (
            key in candidates
            or (only_env and key in siblings)
            or (("_" in key or "." in key) and re.search(rf"(?<![\w.]){re.escape(key)}(?![\w.])", problem))
        )
    ]
    named = [variable for variable in dict.fromkeys(named) if variable not in problem]
    text = f"{problem} (from {', '.join(named)})" if named else problem
    text = logs.redact(text)  # a secret given to the wrong key
    return text.replace("\r", "\\r").replace("\n", "\\n")


def load(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build Settings from a file, the environment and flag overrides; report every problem at once.

    ``env`` defaults to no environment at all; the CLI passes ``os.environ``. A problem with a
    value that a variable set names that variable.
    """
    env = env or {}
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    referenced: set[str] = set()
    path = path or env.get("DRAIN_CONFIG")
    if path:
        data, raw = _read_file(path, env)
        referenced = {name for text in _strings(raw) for name in _ENV_REFERENCE.findall(text)}
        _file_sources(raw, "", sources)
    problems = _apply_environment(data, env, referenced, sources)
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
            sources[key] = f"flag --{key.replace('_', '-')}"
    try:
        settings = parse(data, env=env)
    except errors.ConfigError as exc:
        problems += exc.problems
    if problems:
        raise errors.ConfigError([_with_variables(problem, sources) for problem in problems])
    if "dsn" not in sources and env.get("DATABASE_URL"):
        sources["dsn"] = "env DATABASE_URL"
    return dataclasses.replace(settings, sources=sources)


_SECRET_NAME = re.compile(r"pass(?:word|wd|phrase)?|secret|token|credential|auth|(?:^|_)key(?:$|_)", re.I)
MASK = "***"


def describe(settings: Settings) -> list[tuple[str, str, str]]:
    """Every effective key as ``(dotted key, value, source)``, for ``drain check --show-config``.

    The value is written as in TOML; the source is ``default``, ``file``, ``env DRAIN_...`` or
    ``flag --...``. Secrets never appear: a password in a URL or a DSN is ``***``
    (:func:`redact_url`), and so is the whole value of a key whose name says secret, password,
    token, key or credential. A backend's keys are those configured; the adapter's defaults apply
    to the others.
    """
    sources = settings.sources
    rows: list[tuple[str, str, str]] = []

    def add(key: str, value: Any, source: str | None = None) -> None:
        shown = MASK if _SECRET_NAME.search(key.rsplit(".", 1)[-1]) and value else _masked(value)
        rows.append((key, _toml(shown), source or sources.get(key, "default")))

    for field in dataclasses.fields(Settings):
        if field.name in _NOT_TOP_LEVEL:
            continue
        value = getattr(settings, field.name)
        if field.name == "watchdog_s" and value is None:
            derived = f"default: derived from the timeouts, {settings.watchdog_bound_s():g} s"
            add("watchdog_s", 0, sources.get("watchdog_s", derived))
        elif field.name == "dsn" and not value:
            add("dsn", value, "default: libpq's PG* variables")
        else:
            add(field.name, value)
    listen = settings.metrics_listen
    add("metrics.listen", listen if listen is not None else "", None if listen else "default: off")
    for name, section in settings.backends.items():
        prefix = f"backends.{name}."
        add(f"{prefix}type", section.type)
        attempts = sources.get(f"{prefix}max_attempts") or f"{sources.get('max_attempts', 'default')}"
        add(f"{prefix}max_attempts", section.max_attempts, attempts)
        for key, value in section.options.items():
            add(f"{prefix}{key}", value)
    source = sources.get("schedules", "default")
    for schedule in settings.schedules:
        for field in dataclasses.fields(ScheduleSettings):
            add(f"schedules.{schedule.name}.{field.name}", getattr(schedule, field.name), source)
    return rows


def _masked(value: Any) -> Any:
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, Mapping):
        return {key: MASK if _SECRET_NAME.search(str(key)) else _masked(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_masked(item) for item in value]
    return value


def _toml(value: Any) -> str:
    """``value`` written as a TOML value (any string escaped, so one line)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, Mapping):
        items = ", ".join(f"{json.dumps(str(key))} = {_toml(item)}" for key, item in value.items())
        return f"{{ {items} }}" if items else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if value is None:
        return '""'
    text = json.dumps(str(value), ensure_ascii=False)
    return "".join(char if char.isprintable() else _escaped(char) for char in text)


def _escaped(char: str) -> str:
    code = ord(char)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def parse(data: Mapping[str, Any], *, env: Mapping[str, str] | None = None) -> Settings:
    """Validate an already-merged mapping (the file's shape) into Settings."""
    env = env or {}
    reader = options.OptionReader(data)
    dsn = reader.string("dsn") or env.get("DATABASE_URL") or ""
    schema = reader.string("schema", DEFAULT_SCHEMA) or DEFAULT_SCHEMA
    table = reader.string("table", DEFAULT_TABLE) or DEFAULT_TABLE
    for key, value in (("schema", schema), ("table", table)):
        if not _IDENTIFIER.match(value):
            reader.problem(key, "must be letters, digits and underscores, not starting with a digit")
    reader.problems.extend(sql.name_problems(schema, table))
    level = (reader.string("log_level", "INFO") or "INFO").upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        reader.problem("log_level", "must be one of DEBUG, INFO, WARNING, ERROR")
    log_format = (reader.string("log_format", "text") or "text").lower()
    if log_format not in ("text", "json"):
        reader.problem("log_format", f"must be text or json, not {log_format!r}")
        log_format = "text"
    poll_min = _number(reader, "poll_min_s", POLL_MIN_S)
    poll_max = _number(reader, "poll_max_s", POLL_MAX_S)
    if poll_max < poll_min:
        reader.problem("poll_max_s", "must not be below poll_min_s")
    wakeup_mode = reader.string("wakeup", WAKEUP_NOTIFY) or WAKEUP_NOTIFY
    if wakeup_mode not in WAKEUP_MODES:
        reader.problem("wakeup", f"must be one of {', '.join(WAKEUP_MODES)}, not {wakeup_mode!r}")
        wakeup_mode = WAKEUP_NOTIFY
    wakeup_poll_max = _number(reader, "wakeup_poll_max_s", WAKEUP_POLL_MAX_S)
    watchdog = _number(reader, "watchdog_s", 0.0)
    if 0 < watchdog < WATCHDOG_FLOOR_S:
        reader.problem("watchdog_s", f"must be 0 (derived from the timeouts) or at least {WATCHDOG_FLOOR_S}")
    max_attempts = _integer(reader, "max_attempts", MAX_ATTEMPTS)
    backends = _backends(reader, max_attempts)
    settings = Settings(
        dsn=normalize_dsn(dsn),
        schema=schema,
        table=table,
        batch_size=_integer(reader, "batch_size", DEFAULT_BATCH_SIZE),
        batch_max_bytes=_integer(reader, "batch_max_bytes", BATCH_MAX_BYTES),
        poll_min_s=poll_min,
        poll_max_s=poll_max,
        wakeup=wakeup_mode,
        wakeup_poll_max_s=wakeup_poll_max,
        standby_retry_s=_number(reader, "standby_retry_s", STANDBY_RETRY_S),
        publish_timeout_s=_number(reader, "publish_timeout_s", PUBLISH_TIMEOUT_S),
        max_attempts=max_attempts,
        pipeline_depth=_integer(reader, "pipeline_depth", PIPELINE_DEPTH),
        retry_base_s=_number(reader, "retry_base_s", RETRY_BASE_S),
        retry_max_s=_number(reader, "retry_max_s", RETRY_MAX_S),
        statement_timeout_s=_number(reader, "statement_timeout_s", STATEMENT_TIMEOUT_S),
        settle_timeout_s=_number(reader, "settle_timeout_s", SETTLE_TIMEOUT_S),
        watchdog_s=watchdog or None,
        log_level=level,
        log_format=log_format,
        metrics_listen=_metrics_listen(reader),
        backends=backends,
        schedules=_schedules(reader, backends),
    )
    problems = reader.finish()
    if problems:
        raise errors.ConfigError(problems)
    return settings


def _number(reader: options.OptionReader, key: str, default: float) -> float:
    """A numeric key within its LIMITS."""
    low, high = LIMITS[key]
    return reader.number(key, default, minimum=low, maximum=high)


def _integer(reader: options.OptionReader, key: str, default: int) -> int:
    """An integer key within its LIMITS (also a backend's ``max_attempts``)."""
    low, high = LIMITS[key]
    return reader.integer(key, default, minimum=int(low), maximum=int(high))


def _metrics_listen(reader: options.OptionReader) -> str | None:
    section = reader.table("metrics")
    metrics = options.OptionReader(section, "metrics.")
    listen = metrics.string("listen")
    if listen is not None:
        host, _, port = listen.rpartition(":")
        if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            metrics.problem("listen", f"must be HOST:PORT or :PORT, not {listen!r}")
        elif not host:
            listen = f"{DEFAULT_METRICS_HOST}:{port}"
    reader.problems.extend(metrics.finish())
    return listen


def _backends(reader: options.OptionReader, default_attempts: int) -> dict[str, BackendSettings]:
    found: dict[str, BackendSettings] = {}
    for name, raw_section in reader.table("backends").items():
        prefix = f"backends.{name}."
        if not isinstance(raw_section, dict):
            reader.problems.append(f"backends.{name}: must be a table")
            continue
        section = dict(raw_section)
        type_name = section.pop("type", None)
        if not isinstance(type_name, str) or not type_name:
            known = ", ".join(sorted(backend.BUILTIN_BACKENDS))
            reader.problems.append(f"{prefix}type: is required ({known})")
            continue
        attempts = options.OptionReader(
            {"max_attempts": section.pop("max_attempts")} if "max_attempts" in section else {},
            prefix,
        )
        found[name] = BackendSettings(
            name=name,
            type=type_name,
            max_attempts=_integer(attempts, "max_attempts", default_attempts),
            options=section,
        )
        reader.problems.extend(attempts.finish())
    return found


def _schedules(
    reader: options.OptionReader, backends: Mapping[str, BackendSettings]
) -> tuple[ScheduleSettings, ...]:
    """Every ``[[schedules]]`` entry; each problem names the schedule (``schedules.<name>.<key>``)."""
    # OptionReader has no getter for an array of tables; _get also marks the key as known.
    raw = reader._get("schedules")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        reader.problem("schedules", "must be an array of tables ([[schedules]])")
        return ()
    found: list[ScheduleSettings] = []
    names: set[str] = set()
    for position, entry in enumerate(raw):
        if not isinstance(entry, dict):
            reader.problems.append(f"schedules[{position}]: must be a table")
            continue
        name = entry.get("name")
        label = f"schedules.{name}." if isinstance(name, str) and name else f"schedules[{position}]."
        section = options.OptionReader(entry, label)
        name = section.string("name", required=True)
        if name is not None:
            if len(name) > MAX_SCHEDULE_NAME_CHARS or not name.isprintable():
                section.problem("name", f"must be printable and at most {MAX_SCHEDULE_NAME_CHARS} characters")
            elif name in names:
                section.problem("name", "is used by another schedule")
            names.add(name)
        expression = section.string("cron", required=True)
        tz = section.string("timezone", "UTC") or "UTC"
        try:
            cron.timezone(tz)
        except cron.CronError as exc:
            section.problem("timezone", str(exc))
        if expression is not None:
            try:
                cron.parse(expression)  # the timezone does not change whether it parses
            except cron.CronError as exc:
                section.problem("cron", str(exc))
        job_name = section.string("job_name", required=True)
        args = _schedule_json(section, "args", [], list, "an array")
        kwargs = _schedule_json(section, "kwargs", {}, dict, "a table")
        job_options = _schedule_json(section, "options", {}, dict, "a table")
        queue = section.string("queue", "default") or "default"
        backend_name = section.string("backend", "default") or "default"
        if backends and backend_name not in backends:
            section.problem("backend", f"no backend named {backend_name!r} is configured")
        for key, value in (("job_name", job_name), ("queue", queue), ("backend", backend_name)):
            try:  # the table's own rules: a tick it refuses would fail the leader's every turn
                if value is not None:
                    staging_rows.text(value, key)
            except errors.StagingError as exc:
                section.problem(key, str(exc).removeprefix(f"{key} "))
        catch_up = section.string("catch_up", DEFAULT_CATCH_UP) or DEFAULT_CATCH_UP
        if catch_up not in CATCH_UP_MODES:
            section.problem("catch_up", f"must be one of {', '.join(CATCH_UP_MODES)}, not {catch_up!r}")
            catch_up = DEFAULT_CATCH_UP
        catch_up_max = section.integer("catch_up_max", CATCH_UP_MAX, minimum=1, maximum=MAX_CATCH_UP_MAX)
        reader.problems.extend(section.finish())
        if name is None or expression is None or job_name is None:
            continue
        found.append(
            ScheduleSettings(
                name=name,
                cron=expression,
                job_name=job_name,
                args=tuple(args),
                kwargs=kwargs,
                queue=queue,
                backend=backend_name,
                options=job_options,
                timezone=tz,
                catch_up=catch_up,
                catch_up_max=catch_up_max,
            )
        )
    return tuple(found)


def _schedule_json(section: options.OptionReader, key: str, default: Any, kind: type, what: str) -> Any:
    """A schedule's args/kwargs/options: of ``kind``, and JSON (no TOML dates, no NaN), bounded."""
    value = section._get(key)  # no OptionReader getter for JSON values; marks the key as known
    if value is None:
        return default
    if not isinstance(value, kind):
        section.problem(key, f"must be {what}")
        return default
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        section.problem(key, f"must hold JSON values only (no dates, NaN or infinity): {exc}")
        return default
    if len(text) > MAX_SCHEDULE_PAYLOAD_BYTES:
        section.problem(key, f"is {len(text)} bytes; the limit is {MAX_SCHEDULE_PAYLOAD_BYTES}")
        return default
    return value
