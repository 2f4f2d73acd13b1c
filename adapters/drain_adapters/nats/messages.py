"""Turn one staged job into one NATS message, or refuse it with the reason: pure functions, no I/O.

The message:

- subject ``<subject_prefix>.<queue>``;
- headers (NATS/1.0): ``Nats-Msg-Id`` = ``<job id>:<row id>`` (``msg_id``: JetStream drops a
  re-publish of the same row it has seen within the stream's duplicate window, while a new row
  staged under a job id already forwarded is a new message), ``Content-Type:
  application/json``, ``Drain-Job-Name``, the ordering key as ``x-ordering-key``
  (drain.models.ORDERING_KEY_HEADER), the staging trace context as
  ``traceparent``/``tracestate``, a schedule's tick as ``drain_schedule``/``drain_tick``
  (drain.models.TICK_OPTIONS), and the row's ``headers`` option;
- body: the JSON object the RabbitMQ backend writes, ``{"job_id", "job_name", "args", "kwargs",
  "queue", "created_at", "options"}``.

``build`` raises ``drain.errors.JobRefused`` for what the protocol or the server would refuse, so
that a built message can always be written: a queue that is no valid subject token sequence, a
header name or value a NATS header line cannot hold (a colon or whitespace in a name, a line
break or NUL in a value), a header of the row's named ``Nats-...`` (JetStream acts on those:
``Nats-Rollup`` would purge the stream, ``Nats-Expected-*`` would refuse the publish), an option
other than ``headers``, a body that is no strict JSON, a header block over JetStream's 64 KiB
(MAX_HEADER_BYTES: the stream refuses it, error 10097) and a message over the server's
``max_payload`` (the server would close the connection, failing every job in flight).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from json import encoder as json_encoder
from typing import Any, NamedTuple

from drain import errors, models
from drain_adapters.nats import settings as nats_settings

KNOWN_OPTIONS = ("headers",)
MSG_ID_HEADER = "Nats-Msg-Id"
JOB_NAME_HEADER = "Drain-Job-Name"
CONTENT_TYPE = "application/json"
RESERVED_PREFIX = "nats-"  # JetStream's own headers, compared case-insensitively
MAX_SUBJECT_BYTES = 3_000
"""A subject's longest: its publish line (with the reply subject and the sizes) must fit the
server's max_control_line (4096 bytes by default)."""
MAX_HEADER_BYTES = 65_535
"""The longest header block JetStream stores (its length must fit 16 bits): over it, error 10097."""
STATUS_LINE = b"NATS/1.0\r\n"
PLAIN_HEADERS = (
    f"NATS/1.0\r\n{MSG_ID_HEADER}: %s\r\nContent-Type: {CONTENT_TYPE}\r\n{JOB_NAME_HEADER}: %s\r\n\r\n"
)
"""The header block of a job with no option, trace context, ordering key or tick."""
ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def compact_encoder() -> Callable[[Any], str]:
    """ENCODER's ``encode``, or the same without its per-call set-up where CPython allows.

    ``JSONEncoder.encode`` builds a C encoder at every call; for a ~300-byte body that set-up
    is about half the cost. Built once here, with the same separators and no NaN. It keeps no
    map of the containers it is inside: a job's arguments, read from JSON, cannot hold
    themselves, and a value nested too deeply still raises RecursionError. Where the C encoder
    is missing, or differs from ENCODER on a sample, ENCODER's own ``encode`` is used.
    """
    make = getattr(json_encoder, "c_make_encoder", None)  # CPython's C encoder, undocumented
    if make is None:
        return ENCODER.encode
    try:
        encode = make(
            None, ENCODER.default, json_encoder.encode_basestring_ascii, None, ":", ",", False, False, False
        )
        sample = {"a": ["\u00e9", 1, 2.5, None, True], "b": {}}
        if "".join(encode(sample, 0)) != ENCODER.encode(sample):
            return ENCODER.encode
    except (TypeError, ValueError):  # another signature: another Python
        return ENCODER.encode
    return lambda value: "".join(encode(value, 0))


ENCODE = compact_encoder()


class Message(NamedTuple):
    """One job as it goes on the wire: ``HPUB subject reply len(headers) len(headers + body)``."""

    subject: bytes
    headers: bytes
    body: bytes

    @property
    def size(self) -> int:
        return len(self.headers) + len(self.body)


class Subjects:
    """Each queue's subject (``<subject_prefix>.<queue>``), or the reason it cannot have one,
    remembered for the next batches (at most MAX_REMEMBERED queues; then it starts afresh)."""

    MAX_REMEMBERED = 4096

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._known: dict[str, bytes | str] = {}

    def __call__(self, queue: str) -> bytes:
        """The subject of ``queue``; JobRefused saying why it has none."""
        found = self._known.get(queue)
        if found is None:
            found = self._subject(queue)
            if len(self._known) >= self.MAX_REMEMBERED:
                self._known.clear()
            self._known[queue] = found
        if isinstance(found, str):
            raise errors.JobRefused(found)
        return found

    def _subject(self, queue: str) -> bytes | str:
        problem = nats_settings.subject_problem(queue)
        if problem:
            return f"queue {preview(queue)} {problem}"
        subject = f"{self.prefix}.{queue}".encode()
        if len(subject) > MAX_SUBJECT_BYTES:
            return f"subject of {len(subject)} bytes exceeds {MAX_SUBJECT_BYTES}"
        return subject


def build(job: models.StagedJob, *, subjects: Subjects, max_payload: int) -> Message:
    """The message for ``job``; raise JobRefused saying why it cannot be one."""
    subject = subjects(job.queue)
    job_id = str(job.job_id)
    headers = header_block(job, msg_id(job_id, job.id))  # the job id printed once, for both
    if len(headers) > MAX_HEADER_BYTES:
        raise errors.JobRefused(
            f"headers of {len(headers)} bytes exceed JetStream's limit ({MAX_HEADER_BYTES})"
        )
    message = Message(subject, headers, body(job, job_id))
    size = message.size
    if size > max_payload:
        raise errors.JobRefused(f"message of {size} bytes exceeds the server's max_payload ({max_payload})")
    return message


def msg_id(job_id: str, row_id: int) -> str:
    """``Nats-Msg-Id``: the job id and the row's id, so that only the same row is a duplicate."""
    return f"{job_id}:{row_id}"


def header_block(job: models.StagedJob, message_id: str) -> bytes:
    """The NATS/1.0 header block: the row's ``headers`` option under drain's own headers."""
    name = header_value(job.job_name, "job_name")
    plain = PLAIN_HEADERS % (message_id, name)
    if not job.options and job.traceparent is None and job.ordering_key is None and job.schedule is None:
        return plain.encode()  # most jobs: nothing else to add or check
    unknown = sorted(set(job.options) - set(KNOWN_OPTIONS))
    if unknown:
        raise errors.JobRefused(
            f"unknown NATS option(s) {', '.join(unknown)} (known: {', '.join(KNOWN_OPTIONS)})"
        )
    chosen: dict[str, str] = {}
    if job.traceparent is not None:
        chosen["traceparent"] = job.traceparent
        if job.tracestate is not None:
            chosen["tracestate"] = job.tracestate
    chosen.update(row_headers(job.options.get("headers")))
    chosen.update(models.tick_metadata(job))
    chosen.pop(JOB_NAME_HEADER, None)
    if job.ordering_key is not None:
        chosen[models.ORDERING_KEY_HEADER] = header_value(job.ordering_key, "ordering_key")
    more = "".join(f"{key}: {value}\r\n" for key, value in chosen.items())
    return (plain[:-2] + more + "\r\n").encode()


def row_headers(headers: Any) -> dict[str, str]:
    """The row's ``headers`` option: names a header line can hold, values as text."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise errors.JobRefused("NATS option headers must be an object")
    found: dict[str, str] = {}
    for key, value in headers.items():
        name_problem = header_name_problem(key)
        if name_problem:
            raise errors.JobRefused(f"header {preview(key)} {name_problem}")
        found[key] = header_value(header_text(value, key), f"header {preview(key)}")
    return found


def header_text(value: Any, key: str) -> str:
    """A header value as text: strings as they are, booleans and 64-bit integers written out."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and value.bit_length() <= 64:
        return str(value)
    if isinstance(value, str):
        return value
    raise errors.JobRefused(f"header {preview(key)}: a NATS header value is text, not {type(value).__name__}")


def header_name_problem(name: str) -> str | None:
    if not name:
        return "has an empty name"
    if not name.isascii() or any(char <= " " or char in ":\x7f" for char in name):
        return "has a name with a colon, whitespace, a control or non-ASCII character"
    if name.lower().startswith(RESERVED_PREFIX):
        return "is JetStream's own (Nats-...): a row may not set it"
    return None


def header_value(text: str, what: str) -> str:
    """``text`` if a header line can carry it: valid UTF-8, no line break or NUL."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise errors.JobRefused(f"{what} is not valid Unicode (a lone surrogate)") from None
    if "\r" in text or "\n" in text or "\x00" in text:
        raise errors.JobRefused(f"{what} holds a line break or NUL, which a NATS header cannot carry")
    return text


def body(job: models.StagedJob, job_id: str) -> bytes:
    """The JSON body; JobRefused when a value has no JSON form (NaN, an infinity, too deep)."""
    try:
        text = ENCODE(
            {
                "job_id": job_id,
                "job_name": job.job_name,
                "args": job.args if type(job.args) is list else list(job.args),
                "kwargs": job.kwargs if type(job.kwargs) is dict else dict(job.kwargs),
                "queue": job.queue,
                "created_at": job.created_at.isoformat(),
                "options": job.options if type(job.options) is dict else dict(job.options),
            }
        )
    except ValueError as exc:  # NaN/inf, or an integer too long to print
        raise errors.JobRefused(f"the job's arguments or options are not valid JSON: {exc}") from None
    except RecursionError:
        raise errors.JobRefused("the job's arguments or options are nested too deeply") from None
    return text.encode()  # ASCII: the encoder escapes everything else, lone surrogates too


def preview(value: Any, limit: int = 40) -> str:
    """A bounded ``repr`` for an error message (the reason is stored; a payload is not)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
