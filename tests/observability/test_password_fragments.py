"""No piece of the database password in anything a command writes, whatever its characters.

An independent review (issue 33, item 2) gave ``drain status``, ``check``, ``migrate``, ``dead
list`` and ``run`` a DSN whose password held a raw ``%`` (URL form) or an unquoted space
(``key=value`` form): libpq refused to parse it and quoted the token it stopped at, and 10 of
15 outputs printed that piece of the password. Redacting the DSN was not enough: the error
repeated the secret. Now a DSN libpq cannot parse is refused at load in drain's own words
(``drain.config.parsing.dsn_params``), and every text about a connection (libpq's reason, the
DSN named, every log line) hides every fragment of the password (``redaction.fragments``).

Generated passwords (``%``, spaces, quotes, backslashes, ``=``, ``@``, ``/``, unicode) in every
form a DSN takes (URL raw and percent-encoded, ``DATABASE_URL`` as ``postgresql+psycopg://``,
``key=value`` quoted and unquoted), through every command in process, text and JSON logs, and
one turn of the relay loop with JSON logs: no word of four characters or more of the password,
and not the password itself, in stdout, stderr or the log.
"""

from __future__ import annotations

import io
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from drain import cli, config, errors
from drain.observability import logs, redaction
from drain.relay import loop
from tests import conftest

MISSING_DB = "drain_no_such_database"
BENIGN = "Qx7vRk2Wz9"  # a password no command prints a word of
COMMANDS = (
    ["status"],
    ["check"],
    ["check", "--show-config"],
    ["migrate"],
    ["dead", "list"],
    ["run", "--once"],
)
SPECIALS = ["%", "%zz", "%4", " ", "  ", "'", '"', "\\", "=", "@", "/", ":", "?", "#", "&", "é", "€", "\t"]

words = st.text(alphabet="abcdefghijkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789", min_size=4, max_size=8)
passwords = st.lists(st.one_of(words, st.sampled_from(SPECIALS)), min_size=1, max_size=6).map("".join)


def url(password: str, *, scheme: str = "postgresql", encoded: bool = False) -> str:
    shown = urllib.parse.quote(password, safe="") if encoded else password
    return f"{scheme}://{conftest.PG_USER}:{shown}@{conftest.PG_HOST}:{conftest.PG_PORT}/{MISSING_DB}"


def pairs(password: str, *, quoted: bool) -> str:
    if quoted:
        password = "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return f"host={conftest.PG_HOST} port={conftest.PG_PORT} password={password} dbname={MISSING_DB}"


FORMS = ("url", "url_encoded", "database_url", "pairs_quoted", "pairs_unquoted")


def dsn_and_env(form: str, password: str) -> tuple[list[str], dict[str, str]]:
    """The flags and the environment that give a command this DSN."""
    if form == "database_url":
        return [], {"DATABASE_URL": url(password, scheme="postgresql+psycopg")}
    dsn = {
        "url": lambda: url(password),
        "url_encoded": lambda: url(password, encoded=True),
        "pairs_quoted": lambda: pairs(password, quoted=True),
        "pairs_unquoted": lambda: pairs(password, quoted=False),
    }[form]()
    return ["--dsn", dsn], {}


def pieces(password: str) -> set[str]:
    """What must never be shown: the password, and each word of 4 characters or more in it."""
    found = {word for word in re.findall(r"[^\W_]+", password) if len(word) >= 4}
    if len(password.strip()) >= 4:
        found.add(password)
    return found


def assert_hidden(password: str, *texts: str) -> None:
    for text in texts:
        for piece in pieces(password):
            assert piece not in text, f"{piece!r} of the password shown in: {text!r}"


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    conftest.need_service("PostgreSQL", conftest.PG_HOST, conftest.PG_PORT)
    path = tmp_path_factory.mktemp("fragments") / "drain.toml"
    path.write_text('[backends.default]\ntype = "memory"\n')
    return path


@pytest.fixture(autouse=True)
def _forget_secrets() -> Iterator[None]:
    yield
    redaction.hide(())  # this process's other tests hold no such secret


def unquoted_reads_a_key(form: str, password: str) -> bool:
    """In the unquoted key=value form, `` word=`` inside a password starts the next key, for
    libpq as for drain: ``password=a user=b`` is a password and a user, not one password. And a
    trailing backslash escapes the space after it for libpq: ``password=a\\ dbname=x`` is one
    password, ``a dbname=x``, and the default database (which the server may accept)."""
    if form != "pairs_unquoted":
        return False
    return password.endswith("\\") or re.search(r"\s[A-Za-z_][A-Za-z0-9_]*\s*=", " " + password) is not None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(password=passwords, form=st.sampled_from(FORMS), json_logs=st.booleans())
def test_no_command_shows_a_piece_of_the_password(
    config_file: Path, capsys: pytest.CaptureFixture[str], password: str, form: str, json_logs: bool
) -> None:
    assume(pieces(password) and not unquoted_reads_a_key(form, password))
    shown = {}
    for each in (BENIGN, password):
        flags, env = dsn_and_env(form, each)
        if json_logs:
            env["DRAIN_LOG_FORMAT"] = "json"
        for command in COMMANDS:
            code = cli.main([*command, "--config", str(config_file), *flags], env=env)
            out, err = capsys.readouterr()
            assert code != 0, (command, out, err)  # the database is missing: no command succeeds
            assert err.strip(), command  # and each says why
            shown[each, tuple(command)] = out + err
    # a word the commands print whatever the password (``type`` in backends.default.type) is no piece
    assume(
        not any(
            piece in text for piece in pieces(password) for (each, _), text in shown.items() if each == BENIGN
        )
    )
    for command in COMMANDS:
        assert_hidden(password, shown[password, tuple(command)])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(password=passwords, form=st.sampled_from(FORMS))
def test_the_relay_loop_logs_no_piece_of_the_password(config_file: Path, password: str, form: str) -> None:
    """drain run's loop: a turn that cannot connect logs why (JSON) without the password; a DSN
    libpq cannot parse never reaches it (refused at load, a ConfigError)."""
    assume(pieces(password) and not unquoted_reads_a_key(form, password))
    flags, env = dsn_and_env(form, password)
    try:
        loaded = config.load(config_file, env=env, overrides={"dsn": flags[1] if flags else None})
    except errors.ConfigError as exc:
        assert_hidden(password, str(exc))
        return
    stream = io.StringIO()
    handler = logs.configure("INFO", logs.JSON, stream)
    try:
        relay = loop.Relay(loaded, {})
        relay.turn()
        relay.shutdown()
    finally:
        logs.configure("INFO", logs.TEXT).close()
        handler.close()
    assert "database_error" in stream.getvalue()
    assert_hidden(password, stream.getvalue())
