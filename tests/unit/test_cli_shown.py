"""output.shown: row text printed on a terminal, with nothing a terminal would act on."""

from __future__ import annotations

import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from drain.cli import output

HIDDEN = {"Cc", "Cf", "Zl", "Zp", "Cs"}


@given(st.text())
def test_nothing_a_terminal_acts_on_survives(text: str) -> None:
    shown = output.shown(text)
    assert not [char for char in shown if unicodedata.category(char) in HIDDEN]
    if not [char for char in text if unicodedata.category(char) in HIDDEN]:
        assert shown == text  # printable text is left as it is


@given(st.text())
def test_a_key_is_one_quoted_line(key: str) -> None:
    shown = output.key(key)
    assert shown.startswith('"') and shown.endswith('"')
    assert not [char for char in shown if unicodedata.category(char) in HIDDEN]


def test_the_escapes() -> None:
    assert output.shown("a\x1b[31mb\x9b\u202e\U000e0001") == "a\\x1b[31mb\\x9b\\u202e\\U000e0001"
    assert output.shown("héllo, wörld €") == "héllo, wörld €"
