"""Every numeric key has an upper bound, checked at config load (finding: huge values overflowed).

A value past its bound is one line naming the key and the allowed range; anything accepted keeps
every value derived from it in range: a sleep or a timer (threading.TIMEOUT_MAX), a Postgres
timeout in integer milliseconds, a retried row's run_at before 9999-01-01 (the table's check).
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drain import config, errors
from drain.relay import backoff
from drain.store import session as store

INT4_MAX = 2**31 - 1
# Every number a user can set, by the key a problem names: top-level keys, a backend's
# max_attempts, a schedule's catch_up_max.
TOP_LEVEL = tuple(config.LIMITS)
NESTED = {
    "backends.default.max_attempts": lambda value: {
        "backends": {"default": {"type": "memory", "max_attempts": value}}
    },
    "schedules.nightly.catch_up_max": lambda value: {
        "schedules": [
            {"name": "nightly", "cron": "0 2 * * *", "job_name": "app.nightly", "catch_up_max": value}
        ]
    },
}


def data_for(key: str, value: Any) -> dict[str, Any]:
    return NESTED[key](value) if key in NESTED else {key: value}


def test_every_numeric_setting_has_limits() -> None:
    numeric = {
        field.name
        for field in dataclasses.fields(config.Settings)
        if str(field.type).replace(" ", "") in ("int", "float", "float|None")
    }
    assert numeric == set(TOP_LEVEL)
    for low, high in config.LIMITS.values():
        assert low < high


@pytest.mark.parametrize("key", [*TOP_LEVEL, *NESTED])
@pytest.mark.parametrize("value", [1e300, 10**400, 2**63, 9.9e15])
def test_a_huge_value_is_one_line_naming_the_key_and_its_range(key: str, value: float) -> None:
    with pytest.raises(errors.ConfigError) as caught:
        config.parse(data_for(key, value))
    problems = caught.value.problems
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{key}: must be "), problems
    assert (
        " at least " in problems[0]
        and " and at most " in problems[0]
        and "\n" not in problems[0]
        and len(problems[0]) < 200
    )


def test_a_huge_value_from_the_environment_names_its_variable() -> None:
    with pytest.raises(errors.ConfigError) as caught:
        config.load(env={"DRAIN_POLL_MAX_S": "1e300"})
    (problem,) = caught.value.problems
    assert problem.startswith("poll_max_s: must be at least 0.001 and at most 300")
    assert problem.endswith("(from DRAIN_POLL_MAX_S)")


@pytest.mark.parametrize("key", TOP_LEVEL)
def test_each_upper_bound_itself_is_accepted(key: str) -> None:
    high = config.LIMITS[key][1]
    extra: dict[str, Any] = {"poll_max_s": high} if key == "poll_min_s" else {}
    settings = config.parse({key: high, **extra})
    assert getattr(settings, key) == high
    assert_derived_values_in_range(settings)


def assert_derived_values_in_range(settings: config.Settings) -> None:
    for name, ms in store.session_timeouts_ms(settings).items():
        assert 0 <= ms <= INT4_MAX, (name, ms)
    waits = (
        settings.poll_max_s,
        settings.wakeup_poll_max_s,
        settings.standby_retry_s * 1.5,
        settings.watchdog_bound_s(),
        settings.settle_timeout_s,
        settings.publish_timeout_s,
    )
    assert all(0 < wait <= threading.TIMEOUT_MAX for wait in waits)
    retry = backoff.Backoff(settings.retry_base_s, settings.retry_max_s, lambda: 0.999999)
    delay = retry.delay(backoff.MAX_DOUBLINGS + 1)
    # a row retried a century from now still falls due before the table's 9999-01-01
    assert datetime.datetime(2125, 1, 1) + datetime.timedelta(seconds=delay) < datetime.datetime(9999, 1, 1)
    assert settings.max_attempts <= INT4_MAX


NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.integers(min_value=-(10**500), max_value=10**500),
    st.sampled_from([0, 1, 2**31, 2**63, 10**19, 1e-300, 86400.0, 2592000.0, 1e15]),
)


@given(st.dictionaries(st.sampled_from([*TOP_LEVEL, *NESTED]), NUMBERS, min_size=1, max_size=4))
def test_any_numbers_are_refused_with_their_key_or_keep_everything_in_range(data: dict[str, Any]) -> None:
    merged: dict[str, Any] = {}
    for key, value in data.items():
        merged.update(data_for(key, value))
    try:
        settings = config.parse(merged)
    except errors.ConfigError as exc:
        for problem in exc.problems:
            assert "\n" not in problem and len(problem) < 300, problem
            assert any(key in problem for key in data), (problem, data)
        return
    assert_derived_values_in_range(settings)


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"statement_timeout_s": 300},  # a slow statement: /healthz said wedged after 60 s
        {"publish_timeout_s": 60, "statement_timeout_s": 120},
        {"poll_max_s": 30, "wakeup_poll_max_s": 30, "standby_retry_s": 300},
        {
            "publish_timeout_s": config.MAX_PUBLISH_TIMEOUT_S,
            "statement_timeout_s": config.MAX_STATEMENT_TIMEOUT_S,
        },
    ],
)
def test_every_bound_on_a_turn_counts_the_same_healthy_turn(data: dict[str, Any]) -> None:
    """The watchdog and /healthz judge the same interval (the loop pets one and ticks the other at
    the start of each turn): neither may call a healthy turn wedged, and /healthz answers no later
    than the watchdog acts. The session's fence is the one the healthy turn counts."""
    settings = config.parse(data)
    turn = settings.longest_turn_s()
    fence_s = config.batch_fence_s(settings.publish_timeout_s)
    assert store.idle_in_transaction_timeout_ms(settings.publish_timeout_s) == int(fence_s * 1000)
    assert turn >= settings.statement_timeout_s + fence_s + settings.wakeup_poll_max_s
    assert turn <= settings.stale_after_s() <= settings.watchdog_bound_s()
    assert settings.stale_after_s() >= config.STALE_AFTER_MIN_S


def test_the_healthz_bound_of_the_default_settings() -> None:
    """72 s: a 30 s statement, the 30 s fence, the 10 s armed poll, the 2 s standby retry."""
    assert config.Settings().stale_after_s() == 72.0
    assert config.Settings().watchdog_bound_s() == 144.0
