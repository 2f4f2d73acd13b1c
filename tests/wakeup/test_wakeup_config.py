"""The wake-up's config keys (issue 14): ``wakeup`` and ``wakeup_poll_max_s``, worst values first.

Pure parsing, beside the wake-up's integration tests: every bad value is reported with its key,
never accepted and never a crash.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drain import config, errors


def test_the_defaults() -> None:
    settings = config.parse({})
    assert settings.wakeup == "notify"
    assert settings.wakeup_poll_max_s == config.WAKEUP_POLL_MAX_S
    assert config.parse({"wakeup": "poll"}).wakeup == "poll"
    assert config.load(env={"DRAIN_WAKEUP": "poll"}).wakeup == "poll"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"wakeup": ""}, "wakeup: must be a non-empty string"),
        ({"wakeup": 1}, "wakeup: must be a non-empty string"),
        ({"wakeup": "NOTIFY"}, "wakeup: must be one of notify, poll"),
        ({"wakeup": "notify\x00"}, "wakeup: must be one of notify, poll"),
        ({"wakeup_poll_max_s": 0}, "wakeup_poll_max_s: must be at least"),
        ({"wakeup_poll_max_s": -1}, "wakeup_poll_max_s: must be at least"),
        ({"wakeup_poll_max_s": 31}, "wakeup_poll_max_s: must be at least 0.001 and at most 30"),
        ({"wakeup_poll_max_s": 1e308}, "wakeup_poll_max_s: must be at least 0.001 and at most 30"),
        ({"wakeup_poll_max_s": math.nan}, "wakeup_poll_max_s: must be a finite number"),
        ({"wakeup_poll_max_s": math.inf}, "wakeup_poll_max_s: must be a finite number"),
        ({"wakeup_poll_max_s": "10"}, "wakeup_poll_max_s: must be a finite number"),
        ({"wakeup_poll_max_s": True}, "wakeup_poll_max_s"),
    ],
)
def test_bad_values_are_reported_with_their_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.ConfigError, match=message.replace("(", r"\(")):
        config.parse(data)


@given(st.text(max_size=40))
def test_any_other_string_is_refused(text: str) -> None:
    if text in config.WAKEUP_MODES:
        assert config.parse({"wakeup": text}).wakeup == text
        return
    with pytest.raises(errors.ConfigError, match="wakeup"):
        config.parse({"wakeup": text})


def test_the_watchdog_allows_for_the_longest_armed_sleep() -> None:
    settings = config.parse({"wakeup_poll_max_s": 30})
    assert settings.watchdog_bound_s() >= 2 * 30
