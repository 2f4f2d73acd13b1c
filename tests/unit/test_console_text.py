"""The console's text: whatever a row holds comes out inert (no control, format, separator or
surrogate character left to act), bounded, and with its secrets masked; the admin token's rules."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drain import errors

text = pytest.importorskip("drain.console.text")
access = pytest.importorskip("drain.console.access")

HIDDEN = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}


@given(st.text(), st.integers(min_value=1, max_value=300), st.booleans())
def test_nothing_hidden_survives_and_the_length_is_bounded(value: str, limit: int, lines: bool) -> None:
    shown = text.inert(value, limit, lines=lines)
    assert all(unicodedata.category(c) not in HIDDEN or (lines and c == "\n") for c in shown)
    kept, _, note = shown.partition(" … (")
    assert len(value) <= limit or note.endswith("more characters)")
    assert len(kept) <= limit * 10  # each character at most one escape (\U0010ffff)


def test_what_is_stored_is_what_is_shown_in_its_order() -> None:
    assert text.inert("a\u202eb\x1b[31mc\u2028d\ud800") == "a\\u202eb\\x1b[31mc\\u2028d\\ud800"
    assert text.inert("line\nnext", lines=True) == "line\nnext"
    assert text.inert("line\nnext") == "line\\nnext"
    assert text.inert("x" * 10, 4) == "xxxx … (6 more characters)"


def test_secrets_are_masked_in_arguments_and_errors() -> None:
    value = {"password": "p1", "nested": [{"api_token": "t1"}], "url": "redis://u:p2@h/0", "ok": "<b>"}
    shown = text.pretty(value) + text.brief(value)
    assert not any(secret in shown for secret in ("p1", "t1", "p2"))
    assert "<b>" in shown  # markup is the template's to escape
    assert "p3" not in text.error("connect failed: password=p3 host=db")


def test_the_token_comes_from_the_file_or_the_environment(tmp_path: Path) -> None:
    token = "t" * access.MIN_TOKEN_CHARS
    assert access.token_from({}, None) is None
    assert access.token_from({access.TOKEN_VARIABLE: f" {token}\n"}, None) == token
    path = tmp_path / "token"
    path.write_text(f"{token}x\n")
    assert access.token_from({access.TOKEN_VARIABLE: token}, str(path)) == token + "x"
    for short in ("short", " " * 20 + "x"):
        with pytest.raises(errors.ConfigError) as refused:
            access.token_from({access.TOKEN_VARIABLE: short}, None)
        assert short.strip() not in str(refused.value)
    with pytest.raises(errors.ConfigError):
        access.token_from({}, str(tmp_path / "missing"))


def test_signing_in_gives_a_new_session_and_a_wrong_token_nothing() -> None:
    console = access.Access(token="t" * 20)
    first, session = console.session(None)
    assert console.sign_in(first, "t" * 19, "ops") is None
    signed = console.sign_in(first, "t" * 20, "ops")
    assert signed is not None and signed != first
    assert console.session(signed)[1].operator == "ops"
    assert console.session(first)[0] != first  # the id seen before signing in is worth nothing
    assert console.csrf_ok(session, session.csrf) and not console.csrf_ok(session, None)


def test_sessions_are_bounded_and_expire() -> None:
    now = [0.0]
    console = access.Access(clock=lambda: now[0])
    ids = [console.session(None)[0] for _ in range(access.MAX_SESSIONS + 5)]
    assert console.session(ids[0])[0] != ids[0]  # the oldest went
    assert console.session(ids[-1])[0] == ids[-1]
    now[0] += access.SESSION_S
    assert console.session(ids[-1])[0] != ids[-1]
