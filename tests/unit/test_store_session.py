"""The drain's session parameters, decided before connecting: which hosts libpq will try (the DSN,
else PGHOST / PGHOSTADDR) and whether it is asked for a writable one; the idle_session_timeout
derived from the drain's longest silence."""

from __future__ import annotations

import dataclasses

import pytest

from drain import config
from drain.relay import settle
from drain.store import connection

INT4_MAX = 2**31 - 1


def kwargs(dsn: str, **env: str) -> dict[str, object]:
    return connection.connection_kwargs(config.Settings(dsn=dsn), env=env)


@pytest.mark.parametrize(
    ("dsn", "env", "read_write"),
    [
        ("postgresql://u@a,b/db", {}, True),
        ("host=a,b dbname=db", {}, True),
        ("hostaddr=10.0.0.1,10.0.0.2 dbname=db", {}, True),
        ("postgresql://u@a/db", {}, False),
        ("", {}, False),
        # hosts from the environment, where the DSN names none
        ("dbname=db", {"PGHOST": "a,b"}, True),
        ("", {"PGHOST": "a,b"}, True),
        ("postgresql:///db", {"PGHOSTADDR": "10.0.0.1,10.0.0.2"}, True),
        ("", {"PGHOST": "a"}, False),  # one standby: it connects, and stands by saying why
        ("host=a dbname=db", {"PGHOST": "a,b"}, False),  # the DSN's host wins
        # what the user set stays
        ("postgresql://u@a,b/db?target_session_attrs=any", {}, False),
        ("", {"PGHOST": "a,b", "PGTARGETSESSIONATTRS": "primary"}, False),
        ("host=a,b", {"PGTARGETSESSIONATTRS": "any"}, False),
    ],
)
def test_several_hosts_ask_for_a_writable_one(dsn: str, env: dict[str, str], read_write: bool) -> None:
    wanted = kwargs(dsn, **env)
    assert ("target_session_attrs" in wanted) is read_write, wanted
    if read_write:
        assert wanted["target_session_attrs"] == "read-write"


def test_the_hosts_libpq_tries() -> None:
    assert connection.listed_hosts({}, {}) == 0
    assert connection.listed_hosts({"host": "a,b,c"}, {"PGHOST": "d"}) == 3
    assert connection.listed_hosts({}, {"PGHOST": "d,e"}) == 2
    assert connection.listed_hosts({"host": "a"}, {"PGHOSTADDR": "1.1.1.1,2.2.2.2"}) == 2  # libpq pairs them
    assert connection.listed_hosts({"host": ""}, {"PGHOST": "d,e"}) == 0  # set, to the default socket


def test_the_idle_session_timeout_outlasts_every_legitimate_silence() -> None:
    defaults = config.parse({})
    timeouts = connection.session_timeouts_ms(defaults)
    assert timeouts["idle_session_timeout"] == 20_000  # the armed poll's 10 s, plus the margin
    assert timeouts["transaction_timeout"] == 0
    for changes in (
        {"wakeup_poll_max_s": 30.0},
        {"poll_max_s": 300.0, "poll_min_s": 0.01},
        {"standby_retry_s": 300.0},
        {"wakeup": "poll", "poll_max_s": 45.0},
    ):
        settings = dataclasses.replace(defaults, **changes)  # type: ignore[arg-type]
        idle_ms = connection.session_timeouts_ms(settings)["idle_session_timeout"]
        longest = max(
            settings.poll_max_s,
            settings.wakeup_poll_max_s if settings.wakeup == "notify" else 0,
            settings.standby_retry_s * 1.5,
            settle.RETRY_MAX_S,
        )
        assert idle_ms >= 1000 * (longest + connection.IDLE_SESSION_MARGIN_S), changes
        assert idle_ms <= INT4_MAX
    # the poll mode never sleeps armed: its bound ignores wakeup_poll_max_s
    polling = dataclasses.replace(defaults, wakeup="poll", wakeup_poll_max_s=30.0)
    assert connection.session_timeouts_ms(polling)["idle_session_timeout"] == 20_000
