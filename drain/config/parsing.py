"""Validation: a mapping in the file's shape (already merged from the file, the ``DRAIN_*`` variables
and the flags) into :class:`~drain.config.settings.Settings`, every problem reported at once.

Each problem is one line naming its key (``schedules.<name>.cron: ...``); a value outside its range
(``LIMITS``) names the range.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import conninfo

from drain import backend, errors, models, names
from drain.backend import options
from drain.config import cron
from drain.config.settings import (
    BATCH_MAX_BYTES,
    CATCH_UP_MAX,
    CATCH_UP_MODES,
    DEFAULT_BATCH_SIZE,
    DEFAULT_CATCH_UP,
    DEFAULT_METRICS_HOST,
    LANES,
    LIMITS,
    LOG_REPEAT_S,
    MAX_ATTEMPTS,
    MAX_CATCH_UP_MAX,
    MAX_SCHEDULE_NAME_CHARS,
    MAX_SCHEDULE_PAYLOAD_BYTES,
    PIPELINE_DEPTH,
    POLL_MAX_S,
    POLL_MIN_S,
    PUBLISH_TIMEOUT_S,
    RETRY_BASE_S,
    RETRY_MAX_S,
    SETTLE_TIMEOUT_S,
    STANDBY_RETRY_S,
    STATEMENT_TIMEOUT_S,
    STOP_TIMEOUT_S,
    WAKEUP_MODES,
    WAKEUP_NOTIFY,
    WAKEUP_POLL_MAX_S,
    WATCHDOG_FLOOR_S,
    BackendSettings,
    ScheduleSettings,
    Settings,
)
from drain.staging import rows as staging_rows

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# What libpq says of a connection string it cannot parse, as drain says it without quoting a
# character of the string: libpq quotes the token it stopped at, which may be the password.
_DSN_PROBLEMS = (
    ("percent-encod", "invalid percent-encoding in the URL (write a raw '%' as %25)"),
    ("unexpected spaces", "a space in the URL (write it as %20)"),
    ('missing "="', "a word without '=' in the key=value form (quote a value with spaces: 'a b')"),
    ("unterminated quoted", "an unterminated quoted value in the key=value form"),
    ("invalid connection option", "an unknown keyword in the key=value form"),
    ("invalid URI query parameter", "an unknown parameter in the URL's query"),
    ("end of string", "an unterminated IPv6 host in the URL"),
)
_DSN_UNPARSEABLE = "the connection string cannot be parsed"


def normalize_dsn(dsn: str) -> str:
    """Accept SQLAlchemy-style ``postgresql+psycopg://`` URLs as libpq ones."""
    return re.sub(r"^postgres(?:ql)?\+[a-z0-9_]+://", "postgresql://", dsn)


def dsn_params(dsn: str) -> dict[str, Any]:
    """The parameters libpq reads in ``dsn`` ({} for an empty one).

    ConfigError when libpq cannot parse it, naming the problem in drain's own words: libpq's
    message quotes the token it stopped at, which may be a piece of the password, so none of
    it is shown, whatever the password holds.
    """
    if not dsn:
        return {}
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        said = str(exc)
        problem = next((ours for theirs, ours in _DSN_PROBLEMS if theirs in said), None)
        reason = f"{_DSN_UNPARSEABLE}: {problem}" if problem else _DSN_UNPARSEABLE
        raise errors.ConfigError(f"dsn: {reason}") from None
    except UnicodeDecodeError:  # a %-escape in URL form that decodes to no UTF-8 text
        raise errors.ConfigError(f"dsn: {_DSN_UNPARSEABLE}: a %-escape is not UTF-8") from None
    problems = [f"dsn: {problem}" for problem in _dsn_value_problems(params)]
    if problems:
        raise errors.ConfigError(problems)
    return params


_DSN_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "target_session_attrs": ("any", "read-write", "read-only", "primary", "standby", "prefer-standby"),
    "load_balance_hosts": ("disable", "random"),
}
_DSN_INTEGERS = (
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
)


def _dsn_value_problems(params: Mapping[str, Any]) -> list[str]:
    """What libpq refuses before it connects, so that a connection would fail every time: said
    at load rather than retried for ever. Values are not quoted (a malformed one may hold a piece
    of the password)."""
    problems = [
        f"{key} must be one of {', '.join(choices)}"
        for key, choices in _DSN_CHOICES.items()
        if key in params and str(params[key]) not in choices
    ]
    problems += [
        f"{key} must be a whole number"
        for key in _DSN_INTEGERS
        if key in params and not str(params[key]).strip().lstrip("-").isdigit()
    ]
    ports = str(params.get("port", "") or "").split(",")
    if any(port and not (port.isdigit() and 0 < int(port) < 65536) for port in ports):
        problems.append("port must be a number from 1 to 65535 (one per host)")
    return problems


def parse(data: Mapping[str, Any], *, env: Mapping[str, str] | None = None) -> Settings:
    """Validate an already-merged mapping (the file's shape) into Settings."""
    env = env or {}
    reader = options.OptionReader(data)
    dsn = normalize_dsn(reader.string("dsn") or env.get("DATABASE_URL") or "")
    try:
        dsn_params(dsn)
    except errors.ConfigError as exc:
        reader.problems.extend(exc.problems)
    schema, table = _where(reader)
    level, log_format = _logging(reader)
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
        dsn=dsn,
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
        lanes=_integer(reader, "lanes", LANES),
        retry_base_s=_number(reader, "retry_base_s", RETRY_BASE_S),
        retry_max_s=_number(reader, "retry_max_s", RETRY_MAX_S),
        statement_timeout_s=_number(reader, "statement_timeout_s", STATEMENT_TIMEOUT_S),
        settle_timeout_s=_number(reader, "settle_timeout_s", SETTLE_TIMEOUT_S),
        stop_timeout_s=_number(reader, "stop_timeout_s", STOP_TIMEOUT_S),
        watchdog_s=watchdog or None,
        log_level=level,
        log_format=log_format,
        log_repeat_s=_number(reader, "log_repeat_s", LOG_REPEAT_S),
        metrics_listen=_metrics_listen(reader),
        backends=backends,
        schedules=_schedules(reader, backends),
    )
    problems = reader.finish()
    if problems:
        raise errors.ConfigError(problems)
    return settings


def _where(reader: options.OptionReader) -> tuple[str, str]:
    """``schema`` and ``table``: identifiers, and short enough for every name derived from them."""
    schema = reader.string("schema", models.DEFAULT_SCHEMA) or models.DEFAULT_SCHEMA
    table = reader.string("table", models.DEFAULT_TABLE) or models.DEFAULT_TABLE
    for key, value in (("schema", schema), ("table", table)):
        if not _IDENTIFIER.match(value):
            reader.problem(key, "must be letters, digits and underscores, not starting with a digit")
    reader.problems.extend(names.name_problems(schema, table))
    return schema, table


def _logging(reader: options.OptionReader) -> tuple[str, str]:
    """``log_level`` and ``log_format``."""
    level = (reader.string("log_level", "INFO") or "INFO").upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        reader.problem("log_level", "must be one of DEBUG, INFO, WARNING, ERROR")
    log_format = (reader.string("log_format", "text") or "text").lower()
    if log_format not in ("text", "json"):
        reader.problem("log_format", f"must be text or json, not {log_format!r}")
        log_format = "text"
    return level, log_format


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


CORE_BACKEND_KEYS = ("max_attempts", "block_on_dead_letter")
"""The keys of a ``[backends.NAME]`` section the core reads; the adapter gets the rest."""


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
        core = {key: section.pop(key) for key in CORE_BACKEND_KEYS if key in section}
        attempts = options.OptionReader(core, prefix)
        found[name] = BackendSettings(
            name=name,
            type=type_name,
            max_attempts=_integer(attempts, "max_attempts", default_attempts),
            options=section,
            block_on_dead_letter=attempts.boolean("block_on_dead_letter", False),
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
        schedule = _schedule(section, names, backends)
        reader.problems.extend(section.finish())
        if schedule is not None:
            found.append(schedule)
    return tuple(found)


def _schedule(
    section: options.OptionReader, names: set[str], backends: Mapping[str, BackendSettings]
) -> ScheduleSettings | None:
    """One ``[[schedules]]`` entry (None when its name, cron or job_name is missing); its problems
    go to ``section``; ``names`` collects the names seen so far."""
    name = section.string("name", required=True)
    if name is not None:
        if len(name) > MAX_SCHEDULE_NAME_CHARS or not name.isprintable():
            section.problem("name", f"must be printable and at most {MAX_SCHEDULE_NAME_CHARS} characters")
        elif name in names:
            section.problem("name", "is used by another schedule")
        names.add(name)
    expression, tz = _schedule_time(section)
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
    if name is None or expression is None or job_name is None:
        return None
    return ScheduleSettings(
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


def _schedule_time(section: options.OptionReader) -> tuple[str | None, str]:
    """A schedule's ``cron`` expression (None when missing) and ``timezone``, each checked."""
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
    return expression, tz


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
