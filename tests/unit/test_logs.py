"""drain.observability.logs: JSON lines, the redacting filter, the quiet broker libraries, the CLI's lines."""

from __future__ import annotations

import datetime
import io
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drain import cli, config, errors
from drain.observability import logs, redaction

REQUIRED = ("time", "level", "logger", "message")

# --- a URL with a password, and text around it that holds no URL and no password= pair --------

schemes = st.from_regex(r"[a-z][a-z0-9+.\-]{0,9}", fullmatch=True)
users = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789._-", max_size=12)
# Anything a URL can hold unescaped or not, short of whitespace and control characters: "@",
# ":", "/", quotes, non-ASCII.
passwords = st.text(alphabet=st.characters(blacklist_categories=("Z", "C")), min_size=1, max_size=40).filter(
    lambda secret: secret.strip("*") != ""  # "*".."***" is part of the redaction mark itself
)
hosts = st.from_regex(r"[a-z0-9][a-z0-9.\-]{0,20}(:[0-9]{1,5})?(/[a-z0-9_]{0,10})?", fullmatch=True)
surroundings = st.text(alphabet="abcdefghijklmnopqrstuvwxyz ABCDEFG0123456789,.;()[]'\"!?-_", max_size=40)


def url(scheme: str, user: str, secret: str, host: str) -> str:
    return f"{scheme}://{user}:{secret}@{host}"


@pytest.fixture
def logging_state() -> Iterator[None]:
    """Put back what logs.configure changes: the root's handlers and level, the libraries'
    levels, the warnings capture and the exception hooks."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in logs.THIRD_PARTY}
    hooks = (sys.excepthook, threading.excepthook)
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, old in levels.items():
            logging.getLogger(name).setLevel(old)
        logging.captureWarnings(False)
        sys.excepthook, threading.excepthook = hooks


def emit(log_format: str, message: str, *args: Any, **kwargs: Any) -> str:
    """What one record of a private logger looks like through logs.handler(log_format)."""
    out = io.StringIO()
    logger = logging.getLogger(f"drain.test_logs.{log_format}")
    logger.propagate = False
    logger.handlers[:] = [logs.handler(log_format, out)]
    logger.setLevel(logging.DEBUG)
    logger.warning(message, *args, **kwargs)
    return out.getvalue()


def one_json_line(text: str) -> dict[str, Any]:
    assert text.endswith("\n") and text.count("\n") == 1, text
    record = json.loads(text)
    assert isinstance(record, dict)
    for key in REQUIRED:
        assert key in record, (key, record)
    return record


# --- the JSON line ------------------------------------------------------------------------------


def test_a_json_line_has_the_time_in_utc_the_level_the_logger_the_message_and_the_fields() -> None:
    record = one_json_line(
        emit(
            "json",
            "backend %s unavailable",
            "default",
            extra={"backend": "default", "batch_size": 3, "job_ids": ["a", "b"], "role": "leader"},
        )
    )
    assert record["level"] == "WARNING"
    assert record["logger"] == "drain.test_logs.json"
    assert record["message"] == "backend default unavailable"
    assert (record["backend"], record["batch_size"], record["job_ids"], record["role"]) == (
        "default",
        3,
        ["a", "b"],
        "leader",
    )
    assert record["time"].endswith("Z")
    moment = datetime.datetime.fromisoformat(record["time"].replace("Z", "+00:00"))
    assert moment.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.UTC) - moment).total_seconds()) < 60


def test_an_exception_is_one_json_line_with_the_traceback_in_a_field() -> None:
    try:
        raise ValueError("cannot reach amqp://drain:hunter2@broker:5672/\nsecond line")
    except ValueError:
        out = emit("json", "publishing failed", exc_info=True)
    record = one_json_line(out)
    assert record["message"] == "publishing failed"
    assert record["exception"].startswith("Traceback (most recent call last):")
    assert "ValueError: cannot reach amqp://drain:***@broker:5672/\nsecond line" in record["exception"]
    assert "hunter2" not in out


@pytest.mark.parametrize("log_format", logs.FORMATS)
@pytest.mark.parametrize("ours_first", [True, False])
def test_a_traceback_is_redacted_whichever_handler_renders_it_first(
    log_format: str, ours_first: bool
) -> None:
    """Another handler's formatter may render (and cache in exc_text) the traceback before ours;
    ours keeps exc_info for the handlers after it."""
    ours, theirs, seen = io.StringIO(), io.StringIO(), []
    plain = logging.StreamHandler(theirs)
    plain.setFormatter(logging.Formatter("%(message)s"))
    spy = logging.Handler()
    spy.emit = seen.append  # type: ignore[method-assign]
    handlers = (
        [logs.handler(log_format, ours), plain] if ours_first else [plain, logs.handler(log_format, ours)]
    )
    logger = logging.getLogger(f"drain.test_logs.order.{log_format}.{ours_first}")
    logger.propagate = False
    logger.handlers[:] = [*handlers, spy]
    try:
        raise OSError("cannot reach redis://:pw12345@cache:6379/0")
    except OSError:
        logger.error("failed", exc_info=True)
    assert "pw12345" not in ours.getvalue()
    assert "redis://:***@cache:6379/0" in ours.getvalue()
    assert seen[0].exc_info is not None


def test_the_text_format_is_the_one_from_before() -> None:
    out = emit("text", "leading %s", "public.staged_jobs")
    assert out.endswith(" WARNING drain.test_logs.text: leading public.staged_jobs\n")
    datetime.datetime.strptime(out[:23], "%Y-%m-%d %H:%M:%S,%f")


def test_job_ids_are_strings_and_capped() -> None:
    assert logs.job_ids(["a", 1]) == ["a", "1"]
    assert len(logs.job_ids(range(10_000))) == logs.MAX_JOB_IDS


# --- redaction ----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(schemes, users, passwords, hosts, surroundings, surroundings)
def test_a_password_in_a_url_never_reaches_a_log_line(
    scheme: str, user: str, secret: str, host: str, before: str, after: str
) -> None:
    leaky, safe = url(scheme, user, secret, host), url(scheme, user, redaction.MASK, host)
    expected = f"{before} {safe} {after}"
    assert redaction.redact(f"{before} {leaky} {after}") == expected
    for log_format in logs.FORMATS:
        # in the message itself, and as a %-argument
        for out in (
            emit(log_format, f"{before} {leaky} {after}"),
            emit(log_format, f"{before} %s {after}", leaky),
        ):
            message = json.loads(out)["message"] if log_format == "json" else out.split(": ", 1)[1][:-1]
            assert message == expected
    # in an extra field, and in an exception's text
    record = one_json_line(
        emit("json", "failed", extra={"reason": f"{before} {leaky} {after}", "urls": [leaky]})
    )
    assert record["reason"] == expected and record["urls"] == [safe]
    try:
        raise ConnectionError(f"{before} {leaky} {after}")
    except ConnectionError:
        record = one_json_line(emit("json", "failed", exc_info=True))
    assert f"ConnectionError: {expected}" in record["exception"]
    assert leaky not in record["exception"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("host=db user=drain password=s3cret dbname=app", "host=db user=drain password=*** dbname=app"),
        ("password = 's3 cret' host=db", "password = *** host=db"),
        ("PASSWORD=s3cret", "PASSWORD=***"),
        ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
        ('URI: "postgresql://u:s3cret@[bad/db"', 'URI: "postgresql://u:***@[bad/db"'),
        ("amqp://guest@host/ and postgresql://host/db", "amqp://guest@host/ and postgresql://host/db"),
    ],
)
def test_password_pairs_and_odd_urls_are_redacted(text: str, expected: str) -> None:
    assert redaction.redact(text) == expected
    assert json.loads(emit("json", text))["message"] == expected


def test_a_non_string_field_and_a_bad_format_are_redacted_not_dropped() -> None:
    record = one_json_line(emit("json", "failed", extra={"error": ValueError("amqp://u:pw12345@h/")}))
    assert record["error"] == "amqp://u:***@h/"
    record = one_json_line(emit("json", "%d jobs to %s", "amqp://u:pw12345@h/"))  # wrong arguments
    assert "pw12345" not in json.dumps(record)


# --- configure: one handler, quiet libraries, warnings and uncaught exceptions --------------------


@pytest.mark.usefixtures("logging_state")
@pytest.mark.parametrize("library", logs.THIRD_PARTY)
def test_broker_libraries_are_quiet_unless_debug(library: str) -> None:
    out = io.StringIO()
    logs.configure("INFO", "json", out)
    logging.getLogger(f"{library}.connection").info("chatter")
    logging.getLogger(f"{library}.connection").warning("connection to amqp://u:pw12345@h/ lost")
    logging.getLogger("drain.relay.loop").info("ours")
    lines = [one_json_line(line + "\n") for line in out.getvalue().splitlines()]
    assert [(line["logger"], line["message"]) for line in lines] == [
        (f"{library}.connection", "connection to amqp://u:***@h/ lost"),
        ("drain.relay.loop", "ours"),
    ]
    out = io.StringIO()
    logs.configure("DEBUG", "json", out)
    logging.getLogger(f"{library}.connection").debug("chatter")
    assert [json.loads(line)["message"] for line in out.getvalue().splitlines()] == ["chatter"]
    out = io.StringIO()
    logs.configure("ERROR", "json", out)
    logging.getLogger(f"{library}.connection").warning("below ERROR")
    assert out.getvalue() == ""


@pytest.mark.usefixtures("logging_state")
def test_configure_replaces_its_handler_and_captures_warnings_and_uncaught_exceptions() -> None:
    first = logs.configure("INFO", "text", io.StringIO())
    out = io.StringIO()
    second = logs.configure("INFO", "json", out)
    root = logging.getLogger()
    assert second in root.handlers and first not in root.handlers
    import warnings

    warnings.warn("careful with redis://:pw12345@cache/0", UserWarning, stacklevel=1)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]
    lines = [one_json_line(line + "\n") for line in out.getvalue().splitlines()]
    assert [line["level"] for line in lines] == ["WARNING", "CRITICAL"]
    assert "redis://:***@cache/0" in lines[0]["message"]
    assert "RuntimeError: boom" in lines[1]["exception"]


# --- the CLI's own lines ------------------------------------------------------------------------


def test_render_is_the_old_line_as_text_and_an_error_record_as_json() -> None:
    assert logs.render("no backends configured", "text") == "drain: no backends configured\n"
    record = one_json_line(logs.render("cannot connect to postgresql://u:pw12345@db/app", "json"))
    assert (record["level"], record["logger"]) == ("ERROR", "drain")
    assert record["message"] == "cannot connect to postgresql://u:***@db/app"


@pytest.mark.usefixtures("logging_state")
@pytest.mark.parametrize(
    ("env", "flags", "json_expected"),
    [
        ({}, [], False),
        ({"DRAIN_LOG_FORMAT": "json"}, [], True),
        ({"DRAIN_LOG_FORMAT": "JSON"}, [], True),
        ({"DRAIN_LOG_FORMAT": "json "}, [], False),  # refused by the config, so reported as text
        ({"DRAIN_LOG_FORMAT": "yaml"}, [], False),  # not a format: the config error says so, as text
        ({}, ["--log-format", "json"], True),
    ],
)
def test_a_config_that_fails_to_load_is_reported_in_the_format_the_environment_or_flag_names(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    flags: list[str],
    json_expected: bool,
) -> None:
    bad = tmp_path / "drain.toml"
    bad.write_text('dsn = "postgresql://drain:pw12345@db/app"\nbatch_size = "many"\n')
    assert cli.main(["status", "--config", str(bad), *flags], env=env) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "pw12345" not in err
    if json_expected:
        record = one_json_line(err)
        assert record["level"] == "ERROR"
        assert record["message"].startswith("configuration: batch_size: must be an integer")
    else:
        assert err.startswith("drain: configuration: ") and err.count("\n") == 1


@pytest.mark.usefixtures("logging_state")
def test_a_usage_error_follows_drain_log_format(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--no-such-flag"], env={"DRAIN_LOG_FORMAT": "json"})
    record = one_json_line(capsys.readouterr().err)
    assert "unrecognized arguments: --no-such-flag" in record["message"]


@pytest.mark.usefixtures("logging_state")
def test_the_signal_line_is_json_in_json_mode(capfd: pytest.CaptureFixture[str]) -> None:
    cli._stderr["format"] = logs.JSON
    stop = threading.Event()
    try:
        with cli._signals(stop):
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.wait(5)
    finally:
        cli._stderr["format"] = logs.TEXT
    record = one_json_line(capfd.readouterr().err)
    assert (record["level"], record["signal"], record["event"]) == ("INFO", "SIGTERM", "stopping")
    assert record["message"] == cli.STOPPING


def test_log_format_is_text_or_json_with_the_key_named_otherwise() -> None:
    assert config.load().log_format == "text"
    assert config.load(env={"DRAIN_LOG_FORMAT": "json"}).log_format == "json"
    assert config.parse({"log_format": "JSON"}).log_format == "json"
    for worst in ("yaml", "", 7, ["json"], "json\nlevel=x"):
        with pytest.raises(errors.ConfigError) as caught:
            config.parse({"log_format": worst})
        (line,) = str(caught.value).splitlines()
        assert line.startswith("log_format: ")


# --- one record, one line: row content cannot forge a record (issue 22) -------------------------

# Any text, weighted towards what breaks lines: C0 and C1 controls, DEL, U+2028/2029, CR LF.
line_breakers = st.sampled_from(
    ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1e", "\x85", "\u2028", "\u2029"]
)
hostile_text = st.lists(st.one_of(st.text(max_size=20), line_breakers), max_size=8).map("".join)
TEXT_RECORD_START = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: "


def forged(line: str) -> bool:
    return re.match(TEXT_RECORD_START, line) is not None


@settings(max_examples=300, deadline=None)
@given(hostile_text, hostile_text, hostile_text, hostile_text, st.booleans())
def test_any_text_in_any_field_is_one_text_record_and_forges_none(
    job_name: str, queue: str, reason: str, error: str, with_traceback: bool
) -> None:
    if with_traceback:
        try:
            raise ValueError(error)
        except ValueError:
            out = emit("text", "job %s on %s: %s", job_name, queue, reason, exc_info=True)
    else:
        out = emit("text", f"job {job_name} %s", queue, extra={"queue": queue, "reason": reason})
    assert out.endswith("\n")
    first, *rest = out[:-1].split("\n")
    assert first.splitlines() == [first], "the record's own line is one line for str.splitlines too"
    assert forged(first)
    if not with_traceback:
        assert rest == []
    for line in rest:
        assert line.startswith(logs.TRACEBACK_INDENT) and line.splitlines() == [line], line
        assert not forged(line)


@settings(max_examples=300, deadline=None)
@given(hostile_text, hostile_text, hostile_text, st.booleans())
def test_any_text_in_any_field_is_one_json_line_that_keeps_it(
    job_name: str, queue: str, error: str, with_traceback: bool
) -> None:
    extra = {"job_name": job_name, "queue": queue, "reason": error}
    if with_traceback:
        try:
            raise ValueError(error)
        except ValueError:
            out = emit("json", "job %s", job_name, exc_info=True, extra=extra)
    else:
        out = emit("json", "job %s", job_name, extra=extra)
    assert out.splitlines() == [out[:-1]], "one line, even for str.splitlines"
    record = one_json_line(out)
    assert record["message"] == redaction.redact(f"job {job_name}")
    for key, value in extra.items():
        assert record[key] == redaction.redact(value)
    assert ("exception" in record) == with_traceback


def test_a_forged_line_in_a_job_name_stays_on_its_record() -> None:
    name = "app.tasks.x\n2026-01-02 03:04:05,678 CRITICAL drain.relay.loop: leading\r"
    out = emit("text", "job %s dead-lettered", name)
    assert out.count("\n") == 1
    assert "app.tasks.x\\n2026-01-02 03:04:05,678 CRITICAL drain.relay.loop: leading\\r dead-lettered" in out
    assert logs.render("bad \u2028 value\n", "text") == "drain: bad \\u2028 value\\n\n"


@pytest.mark.parametrize("log_format", logs.FORMATS)
def test_a_lone_surrogate_in_an_error_is_written_escaped_to_a_utf8_stream(log_format: str) -> None:
    """An adapter's error text may hold one; a strict UTF-8 stream (a file, a pipe) would refuse
    the whole record."""
    out = emit(log_format, "job x: %s", "broker said \ud800", extra={"reason": "\udfff"})
    out.encode("utf-8")  # strict
    assert "\\ud800" in out
    if log_format == logs.JSON:  # text lines do not print the extra fields
        assert "\\udfff" in out and one_json_line(out)["reason"] == "\udfff"  # escaped in the line
