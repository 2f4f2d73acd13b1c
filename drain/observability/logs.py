r"""Logging for the ``drain`` command: text lines or JSON lines on stderr, with secrets redacted.

``log_format = "text"`` (the default) writes ``2026-01-02 03:04:05,678 INFO drain.relay.loop: message``;
``"json"`` writes one JSON object per line (python-json-logger), with ``time`` (ISO 8601, UTC),
``level``, ``logger`` and ``message``, then the structured fields a call site passed with
``extra=`` (``backend``, ``queue``, ``batch_size``, ``job_ids``, ``role``, ``attempts``,
``reason``, ...) and, for a record with ``exc_info``, the traceback as one string in
``exception``: never raw multi-line text.

**One record is one line**, whatever a row holds: a job name or queue with a newline must not
forge a log line. In text, every control character and line-breaking code point (C0, DEL, C1
such as U+0085, U+2028, U+2029) of the rendered message is written as its Python escape
(``\n``, ``\x1b``, ``\u2028``: :func:`one_line`), and a traceback follows on continuation lines
that each start with ``TRACEBACK_INDENT``, escaped the same way: only a record's first line
starts in the first column. In JSON, the encoder escapes C0 controls; C1, DEL, U+2028 and U+2029
(which ``str.splitlines`` and some log shippers break on) are written as ``\uXXXX`` too.

Every record, the drain's and the broker libraries' alike, goes through one handler on the root
logger whose :class:`RedactingFilter` replaces the password of any ``scheme://user:password@`` URL
and any ``password=...`` pair, in the message, its arguments, the extra fields and the formatted
traceback (drain.observability.redaction): the last line of defence behind each call site's own
``redaction.redact_url``.

**A repeated warning is one line per cause per interval** (:class:`RepeatFilter`, on the same
handler): the first is written, the same cause again within ``REPEAT_INTERVAL_S`` is counted,
and the next one after it says how many were left out. A cause is the logger, the level, the
message's format (not its arguments: pika names a new channel in each) and the ``backend``,
``queue`` and ``reason`` fields. So a refused permission makes a line every few seconds, not
a hundred a second from the client library.

The broker and HTTP libraries (:data:`THIRD_PARTY`) are held at WARNING unless ``log_level`` is
DEBUG. :func:`render` formats a line without the logging machinery, for the few places that
write to stderr themselves (the CLI's one-line errors, before the config is known; the signal
handler, which must not take the logging locks).
"""

from __future__ import annotations

import datetime
import logging
import re
import sys
import threading
import time
import types
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from pythonjsonlogger import json as jsonlogger

from drain.observability import redaction

TEXT, JSON = "text", "json"
FORMATS = (TEXT, JSON)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
THIRD_PARTY = ("pika", "kombu", "amqp", "celery", "redis", "urllib3", "rq")
MAX_JOB_IDS = 100  # job_ids fields are capped: a batch of 10,000 rows is not a 400 kB log line
TRACEBACK_INDENT = "    "  # a text record's continuation lines (its traceback) start with this
REPEAT_INTERVAL_S = 10.0  # a warning's cause is written at most once per this many seconds
MAX_REPEAT_CAUSES = 4096  # causes remembered at once (all forgotten when full: lines, not memory)

# What breaks or rewrites a line on a terminal or in a log shipper: C0 controls (\n, \r, \v,
# \f, \x1c-\x1e are line breaks for str.splitlines), DEL, C1 controls (U+0085 is NEL), and the
# Unicode line and paragraph separators; and lone surrogates (from an adapter's error text), which
# no UTF-8 stream can write.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_JSON_UNSAFE = re.compile(r"[\x7f-\x9f\u2028\u2029\ud800-\udfff]")  # json.dumps escapes the rest (C0)

_RECORD_ATTRIBUTES = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def one_line(text: str) -> str:
    r"""``text`` with every control character and line-breaking code point written as its Python
    escape (``\n``, ``\x85``, ``\u2028``): printed, it is exactly one line."""
    if _CONTROLS.search(text) is None:
        return text
    return _CONTROLS.sub(lambda found: found.group().encode("unicode_escape").decode("ascii"), text)


def _continuation(text: str) -> str:
    """A multi-line text (a traceback) as continuation lines: each escaped and indented."""
    return "\n".join(TRACEBACK_INDENT + one_line(line) for line in text.split("\n"))


def job_ids(jobs: Iterable[Any]) -> list[str]:
    """The ``job_ids`` field: the jobs' ids (objects with ``job_id``, or ids) as strings, at most
    MAX_JOB_IDS of them."""
    found: list[str] = []
    for job in jobs:
        if len(found) >= MAX_JOB_IDS:
            break
        found.append(str(getattr(job, "job_id", job)))
    return found


class RedactingFilter(logging.Filter):
    """Redact passwords in a record's message, arguments and extra fields (in place).

    The message is rendered once (``msg % args``) and kept as the new ``msg``. A traceback
    another handler's formatter already rendered (``exc_text``) is redacted too; the formatters
    of this module redact the tracebacks they render themselves.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, Mapping):
            record.msg = redaction.redact_value(record.msg)
        else:
            try:
                message = record.getMessage()
            except Exception:  # noqa: BLE001 - a bad %-format: log what there is, redacted
                message = f"{record.msg!s} {record.args!r}"
            record.msg, record.args = redaction.redact(message), ()
        for key, value in list(record.__dict__.items()):
            if key not in _RECORD_ATTRIBUTES and not key.startswith("_"):
                record.__dict__[key] = redaction.redact_value(value)
        if record.exc_text:
            record.exc_text = redaction.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redaction.redact(record.stack_info)
        return True


class RepeatFilter(logging.Filter):
    """Write a warning (or worse) once per cause per ``interval_s``; count the rest, and say how
    many on the next line of that cause (see the module docstring). Thread-safe."""

    def __init__(self, interval_s: float = REPEAT_INTERVAL_S, clock: Any = time.monotonic) -> None:
        super().__init__()
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._causes: dict[tuple[Any, ...], list[float]] = {}  # cause -> [written at, left out]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        fields = record.__dict__
        cause = (
            record.name,
            record.levelno,
            str(record.msg)[:500],
            *(str(fields.get(name, ""))[:500] for name in ("backend", "queue", "reason")),
        )
        now = self._clock()
        with self._lock:
            seen = self._causes.get(cause)
            if seen is not None and now - seen[0] < self._interval_s:
                seen[1] += 1
                return False
            if seen is None and len(self._causes) >= MAX_REPEAT_CAUSES:
                self._causes.clear()
            self._causes[cause] = [now, 0]
        left_out = 0 if seen is None else int(seen[1])
        if left_out:
            try:
                message = record.getMessage()
            except Exception:  # noqa: BLE001 - a bad %-format: RedactingFilter copes with it
                return True
            record.msg = f"{message} ({left_out} more like this in the last {now - seen[0]:.0f}s)"  # type: ignore[index]
            record.args = ()
            record.__dict__["repeated"] = left_out
        return True


class JsonFormatter(jsonlogger.JsonFormatter):
    """One JSON object per record: time, level, logger, message, the extra fields, exception."""

    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={
                "asctime": "time",
                "levelname": "level",
                "name": "logger",
                "exc_info": "exception",
                "stack_info": "stack",
            },
            json_ensure_ascii=False,
        )

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if _JSON_UNSAFE.search(text) is None:
            return text
        return _JSON_UNSAFE.sub(lambda found: f"\\u{ord(found.group()):04x}", text)  # inside strings only

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return iso_time(record.created)

    def formatException(self, ei: Any) -> str:
        return redaction.redact(_joined(super().formatException(ei)))

    def formatStack(self, stack_info: str) -> str:
        return redaction.redact(_joined(super().formatStack(stack_info)))


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT on one line (:func:`one_line`), then the traceback and stack, if any, on
    indented continuation lines; tracebacks redacted like messages."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        lines = [one_line(self.formatMessage(record))]
        if record.exc_info:
            lines.append(_continuation(self.formatException(record.exc_info)))
        elif record.exc_text:
            lines.append(_continuation(record.exc_text))
        if record.stack_info:
            lines.append(_continuation(self.formatStack(record.stack_info)))
        return "\n".join(lines)

    def formatException(self, ei: Any) -> str:
        return redaction.redact(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return redaction.redact(super().formatStack(stack_info))


def _joined(text: str | list[str]) -> str:
    return text if isinstance(text, str) else "\n".join(text)  # a list only with *_as_array


def iso_time(seconds: float) -> str:
    """``seconds`` since the epoch as ISO 8601 in UTC, to the millisecond: 2026-01-02T03:04:05.678Z."""
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def formatter(log_format: str) -> logging.Formatter:
    """The formatter of ``log_format`` (``text`` or ``json``)."""
    return JsonFormatter() if log_format == JSON else TextFormatter()


class StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever ``sys.stderr`` is at the time of each record (tests swap it)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__()
        self._fixed = stream

    @property
    def stream(self) -> TextIO:
        return self._fixed or sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # StreamHandler.__init__ assigns sys.stderr; the property decides at write time


def handler(
    log_format: str, stream: TextIO | None = None, repeat_s: float = REPEAT_INTERVAL_S
) -> logging.Handler:
    """A handler for ``log_format`` on ``stream`` (default: sys.stderr), with the RepeatFilter and
    the RedactingFilter."""
    made = StderrHandler(stream)
    made.setFormatter(formatter(log_format))
    if repeat_s > 0:
        made.addFilter(RepeatFilter(repeat_s))
    made.addFilter(RedactingFilter())
    return made


def configure(
    level: str, log_format: str, stream: TextIO | None = None, *, repeat_s: float = REPEAT_INTERVAL_S
) -> logging.Handler:
    """Route every record through one handler on the root logger; hold THIRD_PARTY at WARNING
    unless ``level`` is DEBUG. Replaces the handler an earlier call installed. In JSON mode
    Python warnings and uncaught exceptions are logged too, so nothing else reaches stderr."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, StderrHandler)]:
        root.removeHandler(old)
    installed = handler(log_format, stream, repeat_s)
    root.addHandler(installed)
    root.setLevel(level)
    quiet = max(logging.WARNING, logging.getLevelName(level)) if level != "DEBUG" else logging.DEBUG
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(quiet)
    if log_format == JSON:
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
    return installed


def _log_uncaught(
    kind: type[BaseException], value: BaseException, traceback: types.TracebackType | None
) -> None:
    logging.getLogger("drain").critical(
        "uncaught exception: %s", kind.__name__, exc_info=(kind, value, traceback)
    )


def _log_uncaught_in_thread(hook: threading.ExceptHookArgs) -> None:
    if hook.exc_type is SystemExit or hook.exc_value is None:
        return
    logging.getLogger("drain").critical(
        "uncaught exception in thread %s: %s",
        hook.thread.name if hook.thread else "?",
        hook.exc_type.__name__,
        exc_info=(hook.exc_type, hook.exc_value, hook.exc_traceback),
    )


def render(message: str, log_format: str, *, level: int = logging.ERROR, **fields: Any) -> str:
    """One stderr line (with its newline) for a message written outside logging: ``drain:
    message`` as text, or the JSON object a ``drain`` logger record would be. Takes no lock, so
    a signal handler may call it."""
    if log_format != JSON:
        return f"drain: {one_line(redaction.redact(message))}\n"
    record = logging.makeLogRecord(
        {"name": "drain", "levelno": level, "levelname": logging.getLevelName(level), "msg": message}
    )
    record.__dict__.update(fields)
    RedactingFilter().filter(record)
    return JsonFormatter().format(record) + "\n"


def format_from(env: Mapping[str, str]) -> str:
    """The format to use before the config is known: ``DRAIN_LOG_FORMAT`` if valid, else text."""
    chosen = env.get("DRAIN_LOG_FORMAT", "").lower()  # as config.parse reads it
    return chosen if chosen in FORMATS else TEXT
