"""``[[schedules]]`` in the config file: every problem at once, each with its schedule's name."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drain import config, errors

BACKEND = """
[backends.default]
type = "rq"
url = "redis://127.0.0.1:6379/0"
"""


def load(tmp_path: pathlib.Path, text: str) -> config.Settings:
    path = tmp_path / "drain.toml"
    path.write_text(text + "\n" + BACKEND)
    return config.load(path, env={"TZ_NAME": "Europe/Berlin"})


def problems(tmp_path: pathlib.Path, text: str) -> list[str]:
    with pytest.raises(errors.ConfigError) as caught:
        load(tmp_path, text)
    return caught.value.problems


def test_a_full_schedule(tmp_path: pathlib.Path) -> None:
    settings_ = load(
        tmp_path,
        """
[[schedules]]
name = "nightly-report"
cron = "0 3 * * *"
job_name = "app.tasks.nightly_report"
args = [1, "two"]
kwargs = { region = "eu" }
queue = "reports"
backend = "default"
options = { timeout = 60 }
timezone = "${TZ_NAME}"
catch_up = "all"
catch_up_max = 5

[[schedules]]
name = "every-second"
cron = "* * * * * *"
job_name = "app.tasks.tick"
""",
    )
    first, second = settings_.schedules
    assert first == config.ScheduleSettings(
        name="nightly-report",
        cron="0 3 * * *",
        job_name="app.tasks.nightly_report",
        args=(1, "two"),
        kwargs={"region": "eu"},
        queue="reports",
        backend="default",
        options={"timeout": 60},
        timezone="Europe/Berlin",
        catch_up="all",
        catch_up_max=5,
    )
    assert (second.timezone, second.catch_up, second.catch_up_max) == ("UTC", "latest", 100)
    assert (second.queue, second.backend, second.args, second.kwargs) == ("default", "default", (), {})


def test_no_schedules(tmp_path: pathlib.Path) -> None:
    assert load(tmp_path, "").schedules == ()


def test_every_problem_is_reported_at_once_with_the_schedule_name(tmp_path: pathlib.Path) -> None:
    found = problems(
        tmp_path,
        """
[[schedules]]
name = "bad-cron"
cron = "61 * * * *"
job_name = "app.tasks.a"
timezone = "Mars/Olympus"

[[schedules]]
name = "bad-values"
cron = "* * * * *"
job_name = "app.tasks.b"
backend = "nowhere"
catch_up = "sometimes"
catch_up_max = 0
args = { not = "a list" }
kwargs = [1]
options = { when = 1979-05-27T07:32:00Z }
colour = "blue"

[[schedules]]
name = "bad-cron"
cron = "* * * * *"
job_name = "app.tasks.c"

[[schedules]]
cron = "* * * * *"
""",
    )
    assert found == [
        "schedules.bad-cron.timezone: unknown timezone 'Mars/Olympus'",
        "schedules.bad-cron.cron: the cron expression '61 * * * *' is not valid: Bad minute",
        "schedules.bad-values.args: must be an array",
        "schedules.bad-values.kwargs: must be a table",
        found[4],
        "schedules.bad-values.backend: no backend named 'nowhere' is configured",
        "schedules.bad-values.catch_up: must be one of all, latest, none, not 'sometimes'",
        "schedules.bad-values.catch_up_max: must be at least 1 and at most 1000, not 0",
        "schedules.bad-values.colour: unknown key",
        "schedules.bad-cron.name: is used by another schedule",
        "schedules[3].name: is required",
        "schedules[3].job_name: is required",
    ]
    assert found[4].startswith("schedules.bad-values.options: must hold JSON values only")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('schedules = "nope"', "schedules: must be an array of tables ([[schedules]])"),
        ("schedules = [1]", "schedules[0]: must be a table"),
        ('[[schedules]]\nname = ""\ncron = "* * * * *"\njob_name = "a.b"', "must be a non-empty string"),
        ('[[schedules]]\nname = "a\\u0000b"\ncron = "* * * * *"\njob_name = "a.b"', "must be printable"),
        (f'[[schedules]]\nname = "{"n" * 201}"\ncron = "* * * * *"\njob_name = "a.b"', "at most 200"),
        ('[[schedules]]\nname = "n"\ncron = "* * * * *"\njob_name = "a.b"\nargs = [nan]', "JSON values only"),
        ('[[schedules]]\nname = "n"\ncron = 5\njob_name = "a.b"', "cron: must be a non-empty string"),
        # what the table refuses (a tick refused at INSERT would fail the leader's every turn)
        ('[[schedules]]\nname = "n"\ncron = "* * * * *"\njob_name = "a.b"\nqueue = " "', "queue: must be"),
        (f'[[schedules]]\nname = "n"\ncron = "* * * * *"\njob_name = "{"a" * 1025}"', "1025 bytes"),
    ],
)
def test_worst_values(tmp_path: pathlib.Path, value: str, message: str) -> None:
    assert any(message in problem for problem in problems(tmp_path, value))


def test_a_huge_payload_is_refused(tmp_path: pathlib.Path) -> None:
    text = f'[[schedules]]\nname = "n"\ncron = "* * * * *"\njob_name = "a.b"\nargs = ["{"x" * (1 << 20)}"]'
    assert any("the limit is" in problem for problem in problems(tmp_path, text))


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["name", "cron", "job_name", "timezone", "catch_up"]), st.text()))
def test_any_strings_parse_or_raise_config_error(entry: dict[str, str]) -> None:
    try:
        config.parse({"schedules": [entry]})
    except errors.ConfigError as exc:
        assert exc.problems
