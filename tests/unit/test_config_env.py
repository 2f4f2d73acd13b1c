"""Every configuration key from the environment, walked from the docs' own tables.

The docs' configuration reference (generated from drain/config/settings.py) and the TOML examples of each
backend's page are the source of truth: each key they list is set here from its ``DRAIN_*``
variable only, and ``config.load`` must yield that value and say where it came from.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import tomllib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drain import backend, config, errors
from drain.observability import redaction
from tests.support import docs

# Text keys need a valid value chosen by hand; numbers are derived from their defaults.
TEXT_VALUES: dict[str, str] = {
    "dsn": "postgresql://app@db.internal/app",
    "schema": "jobs",
    "table": "queued_jobs",
    "wakeup": "poll",
    "log_level": "DEBUG",
    "log_format": "json",
    "metrics.listen": "0.0.0.0:9100",
}
SECRET = "s3cret-Zq9"


def configuration_section() -> str:
    return docs.page("configuration.md")


def table_keys() -> list[str]:
    """The keys of the configuration reference's rows, as dotted keys."""
    section = docs.config_reference().markdown()
    lines = section[section.index("| key | variable | default | range | meaning |") :].splitlines()[2:]
    keys: list[str] = []
    for line in lines:
        if not line.startswith("|"):
            break
        cell = line.split("|")[1]
        for name in re.findall(r"`([^`]+)`", cell):
            table = re.fullmatch(r"\[(\w+)\] (\w+)", name)
            keys.append(f"{table.group(1)}.{table.group(2)}" if table else name.strip("[]"))
    return keys


def toml_examples(page: str) -> list[str]:
    """The first ```toml block of the docs page ``page``, each line uncommented (``# key = v`` too)."""
    text = docs.page(page)
    block = text[text.index("```toml\n") + len("```toml\n") :]
    block = block[: block.index("```")]
    return [re.sub(r"^#\s*", "", line) for line in block.splitlines()]


def backend_examples() -> dict[str, dict[str, Any]]:
    """Each backend page's keys and example values, by backend type."""
    found: dict[str, dict[str, Any]] = {}
    for page in ("backends/rq.md", "backends/rabbitmq.md", "backends/celery.md"):
        keys: dict[str, Any] = {}
        for line in toml_examples(page):
            try:
                parsed = tomllib.loads(re.sub(r"\$\{\w+\}", SECRET, line))
            except tomllib.TOMLDecodeError:
                continue  # prose in a comment
            keys.update({k: v for k, v in parsed.items() if not isinstance(v, dict)})
        found[keys.pop("type")] = keys
    return found


def toml_value(value: Any) -> str:
    """``value`` as an inline TOML value (JSON for scalars and arrays of them)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return json.dumps(value)


def other_value(key: str) -> Any:
    """A valid value of ``key`` other than its default."""
    if key in TEXT_VALUES:
        return TEXT_VALUES[key]
    default = {field.name: field.default for field in dataclasses.fields(config.Settings)}[key]
    if default is None:  # watchdog_s: derived unless set
        return 90.0
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    assert isinstance(default, float), f"add a value for {key} to TEXT_VALUES"
    highest = config.LIMITS[key][1]
    return default * 2 if default * 2 <= highest else (default + highest) / 2


def test_the_reference_lists_exactly_the_top_level_keys() -> None:
    listed = set(table_keys())
    assert "backends.NAME" in listed
    listed.discard("backends.NAME")
    assert listed == {*config.top_level_keys(), "metrics.listen"}


@pytest.mark.parametrize("key", [key for key in table_keys() if key != "backends.NAME"])
def test_every_key_of_the_reference_is_settable_from_the_environment(key: str) -> None:
    value = other_value(key)
    variable = config.environment_variable(key)
    settings = config.load(env={variable: str(value)})
    field = "metrics_listen" if key == "metrics.listen" else key
    assert getattr(settings, field) == value
    assert settings.sources[key] == f"env {variable}"


def test_the_variable_names_follow_the_documented_scheme() -> None:
    assert config.environment_variable("poll_max_s") == "DRAIN_POLL_MAX_S"
    assert config.environment_variable("metrics.listen") == "DRAIN_METRICS__LISTEN"
    assert config.environment_variable("backends.default.url") == "DRAIN_BACKENDS__DEFAULT__URL"
    section = configuration_section()
    for variable in ("DRAIN_POLL_MAX_S", "DRAIN_METRICS__LISTEN", "DRAIN_BACKENDS__DEFAULT__URL"):
        assert variable in section


@pytest.mark.parametrize("backend_type", ["rq", "rabbitmq", "celery"])
def test_a_backend_is_defined_from_the_environment_alone(backend_type: str) -> None:
    """type, max_attempts and every key of the backend page's example, each from its own variable."""
    keys = backend_examples()[backend_type]
    assert keys, backend_type
    env = {"DRAIN_BACKENDS__EVENTS__TYPE": backend_type, "DRAIN_BACKENDS__EVENTS__MAX_ATTEMPTS": "3"}
    for key, value in keys.items():
        text = value if isinstance(value, str) else json.dumps(value)
        env[f"DRAIN_BACKENDS__EVENTS__{key.upper()}"] = text
    settings = config.load(env=env)
    section = settings.backends["events"]
    assert (section.type, section.max_attempts) == (backend_type, 3)
    assert dict(section.options) == keys
    assert settings.sources["backends.events.url" if "url" in keys else "backends.events.broker_url"]
    # the adapter accepts every value as typed from the text (no I/O here)
    adapters = backend.build_adapters(settings.backends, settings.publish_timeout_s)
    assert set(adapters) == {"events"}


def test_the_documented_schedule_is_settable_as_drain_schedules_in_toml_and_json() -> None:
    example = tomllib.loads("\n".join(toml_examples("scheduling.md")))["schedules"][0]
    backends = {"DRAIN_BACKENDS__DEFAULT__TYPE": "memory"}
    for text in (f"[{toml_value(example)}]", json.dumps([example])):
        settings = config.load(env={**backends, "DRAIN_SCHEDULES": text})
        (schedule,) = settings.schedules
        for key, value in example.items():
            got = getattr(schedule, key)
            assert (list(got) if key == "args" else got) == value, key
        assert settings.sources["schedules"] == "env DRAIN_SCHEDULES"


def test_a_scheduled_backend_key_from_the_environment_overrides_the_file_ones(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "drain.toml"
    path.write_text(
        'poll_max_s = 0.5\nbatch_size = 20\n[backends.Events]\ntype = "rabbitmq"\n'
        'url = "amqp://guest:guest@file/%2F"\nexchange = "jobs"\n'
    )
    env = {
        "DRAIN_POLL_MAX_S": "0.7",
        "DRAIN_BATCH_SIZE": "30",
        "DRAIN_BACKENDS__EVENTS__URL": "amqp://guest:guest@env/%2F",
        "DRAIN_BACKENDS__TASKS__TYPE": "memory",
    }
    settings = config.load(path, env=env, overrides={"batch_size": 40})
    assert (settings.poll_max_s, settings.batch_size) == (0.7, 40)  # env over file, flag over env
    assert settings.sources["poll_max_s"] == "env DRAIN_POLL_MAX_S"
    assert settings.sources["batch_size"] == "flag --batch-size"
    # a file backend is matched case-insensitively; an environment-only one is named in lower case
    assert set(settings.backends) == {"Events", "tasks"}
    assert settings.backends["Events"].options == {"url": "amqp://guest:guest@env/%2F", "exchange": "jobs"}
    assert settings.sources["backends.Events.exchange"] == "file"
    assert settings.sources["backends.Events.url"] == "env DRAIN_BACKENDS__EVENTS__URL"


def test_a_variable_matching_two_file_backends_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "drain.toml"
    path.write_text('[backends.events]\ntype = "memory"\n[backends.Events]\ntype = "memory"\n')
    with pytest.raises(errors.ConfigError, match="DRAIN_BACKENDS__EVENTS__TYPE: the file has backends"):
        config.load(path, env={"DRAIN_BACKENDS__EVENTS__TYPE": "rq"})


def test_the_old_metrics_variable_still_works_and_the_new_one_wins() -> None:
    assert config.load(env={"DRAIN_METRICS_LISTEN": ":9100"}).metrics_listen == "127.0.0.1:9100"
    both = {"DRAIN_METRICS_LISTEN": ":9100", "DRAIN_METRICS__LISTEN": ":9200"}
    assert config.load(env=both).metrics_listen == "127.0.0.1:9200"


@pytest.mark.parametrize(
    ("text", "string", "value"),
    [
        ("500", False, 500),
        ("0.5", False, 0.5),
        ("true", False, True),
        ('["emails", "reports"]', False, ["emails", "reports"]),
        ("{ max = 3, interval = [10, 60] }", False, {"max": 3, "interval": [10, 60]}),
        ("redis://:pw@h:6379/0", False, "redis://:pw@h:6379/0"),
        ("app.tasks.*", False, "app.tasks.*"),
        ('"1234"', False, "1234"),
        ("1\nother = 2", False, "1\nother = 2"),  # not one value: never a second key
        ("2024-01-01", False, "2024-01-01"),
        ("[[[", False, "[[["),
        ("[" * 5000 + "]" * 5000, False, "[" * 5000 + "]" * 5000),
        ("9" * 5000, False, "9" * 5000),  # past int()'s digit limit
        ("true", True, "true"),  # a text key takes the text
        ("42", True, "42"),
        ('"quoted"', True, "quoted"),
    ],
)
def test_a_variable_is_read_as_toml_when_it_is_a_toml_value(text: str, string: bool, value: Any) -> None:
    assert config.environment_value(text, string=string) == value


def test_a_misspelt_variable_is_refused_with_its_name() -> None:
    with pytest.raises(errors.ConfigError) as caught:
        config.load(env={"DRAIN_BATCH_SIZ": "100"})
    assert str(caught.value) == (
        "DRAIN_BATCH_SIZ: no setting has this variable (did you mean DRAIN_BATCH_SIZE?); unset it"
    )
    for variable in ("DRAIN_BACKENDS__DEFAULT", "DRAIN_BACKENDS____URL", "DRAIN_METRICS__PORT", "DRAIN_"):
        with pytest.raises(errors.ConfigError, match=re.escape(variable)):
            config.load(env={variable: "x"})


@pytest.mark.parametrize(
    "variable",
    [
        "DRAIN_CONFIG_UNUSED_BUT_EMPTY",  # empty: unset
        "DRAIN_FAILPOINTS",
        "DRAIN_TEST_REDIS",
        "DRAIN_SERVICE_HOST",  # Kubernetes, for a Service named drain
        "DRAIN_SERVICE_PORT_METRICS",
        "DRAIN_PORT",
        "DRAIN_PORT_9464_TCP_ADDR",
        "DRAIN_METRICS_SERVICE_PORT",  # ... and one named drain-metrics
    ],
)
def test_variables_that_are_no_settings_are_left_alone(variable: str) -> None:
    value = "" if variable.endswith("EMPTY") else "10.0.0.7"
    assert config.load(env={variable: value}) == config.Settings()


def test_a_variable_the_file_references_is_not_unknown(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "drain.toml"
    path.write_text('[backends.default]\ntype = "rq"\nurl = "redis://:${DRAIN_REDIS_PASSWORD}@h/0"\n')
    settings = config.load(path, env={"DRAIN_REDIS_PASSWORD": SECRET})
    assert settings.backends["default"].options["url"] == f"redis://:{SECRET}@h/0"
    assert settings.sources["backends.default.url"] == "file ${DRAIN_REDIS_PASSWORD}"
    assert settings.sources["backends.default.type"] == "file"


def test_a_bad_value_names_its_variable_and_the_key() -> None:
    with pytest.raises(errors.ConfigError) as caught:
        config.load(env={"DRAIN_BATCH_SIZE": "many", "DRAIN_POLL_MIN_S": "5"})
    assert caught.value.problems == [
        "poll_max_s: must not be below poll_min_s (from DRAIN_POLL_MIN_S)",
        "batch_size: must be an integer, not 'many' (from DRAIN_BATCH_SIZE)",
    ]


def test_a_problem_stays_on_one_line_whatever_the_value() -> None:
    with pytest.raises(errors.ConfigError) as caught:
        config.load(env={"DRAIN_SCHEDULES": '[{ name = "a\\nb\\r", cron = "* * * * *" }]'})
    assert "\n" not in str(caught.value) and "\r" not in str(caught.value)
    assert "schedules.a\\nb\\r.job_name: is required (from DRAIN_SCHEDULES)" in caught.value.problems


def test_a_secret_in_the_wrong_variable_stays_out_of_the_error() -> None:
    env = {
        "DRAIN_BATCH_SIZE": f"redis://:{SECRET}@redis:6379/0",
        "DRAIN_MAX_ATTEMPTS": f"amqp://app:{SECRET}@rabbit/%2F",
        "DRAIN_POLL_MAX_S": f"host=db password={SECRET}",
    }
    with pytest.raises(errors.ConfigError) as caught:
        config.load(env=env)
    assert "batch_size: must be an integer, not 'redis://:***@redis:6379/0'" in str(caught.value)
    assert SECRET not in str(caught.value)


def test_show_config_lists_every_key_with_its_source_and_no_secret(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "drain.toml"
    path.write_text(
        f'dsn = "postgresql://drain:{SECRET}@db/app"\nstatement_timeout_s = 20\n'
        '[[schedules]]\nname = "n"\ncron = "* * * * *"\njob_name = "app.tasks.n"\n'
        f'kwargs = {{ api_token = "{SECRET}", user = "u" }}\n'
    )
    env = {
        "DRAIN_BACKENDS__DEFAULT__TYPE": "rq",
        "DRAIN_BACKENDS__DEFAULT__URL": f"redis://:{SECRET}@redis:6379/0",
        "DRAIN_BACKENDS__DEFAULT__PASSWORD": SECRET,
        "DRAIN_BACKENDS__DEFAULT__ALLOWED_JOBS": '["app.tasks.*"]',
        "DRAIN_METRICS_LISTEN": ":9100",
    }
    settings = config.load(path, env=env, overrides={"table": "jobs"})
    rows = {key: (value, source) for key, value, source in config.describe(settings)}
    assert SECRET not in repr(rows)
    assert rows["dsn"] == ('"postgresql://drain:***@db/app"', "file")
    assert rows["table"] == ('"jobs"', "flag --table")
    assert rows["batch_size"] == ("500", "default")
    assert rows["statement_timeout_s"] == ("20.0", "file")
    assert rows["watchdog_s"][1].startswith("default: derived")
    assert rows["metrics.listen"] == ('"127.0.0.1:9100"', "env DRAIN_METRICS_LISTEN")
    assert rows["backends.default.type"] == ('"rq"', "env DRAIN_BACKENDS__DEFAULT__TYPE")
    assert rows["backends.default.url"] == ('"redis://:***@redis:6379/0"', "env DRAIN_BACKENDS__DEFAULT__URL")
    assert rows["backends.default.password"][0] == '"***"'
    assert rows["backends.default.allowed_jobs"][0] == '["app.tasks.*"]'
    assert rows["schedules.n.kwargs"] == ('{ "api_token" = "***", "user" = "u" }', "file")
    shown = {key for key in rows if "." not in key}
    assert shown == set(config.top_level_keys())


def test_show_config_values_stay_on_one_line() -> None:
    settings = config.load(
        env={"DRAIN_BACKENDS__X__TYPE": "memory", "DRAIN_BACKENDS__X__NOTE": "a\nb\u2028c\udce9"}
    )
    (line,) = [value for key, value, _ in config.describe(settings) if key == "backends.x.note"]
    assert line == '"a\\nb\\u2028c\\udce9"'


VARIABLES = [config.environment_variable(key) for key in (*config.top_level_keys(), "metrics.listen")] + [
    "DRAIN_METRICS_LISTEN",
    "DRAIN_SCHEDULES",
    "DRAIN_BACKENDS__DEFAULT__TYPE",
    "DRAIN_BACKENDS__DEFAULT__MAX_ATTEMPTS",
    "DRAIN_BACKENDS__DEFAULT__URL",
]
TOMLISH = st.sampled_from(
    ["0", "-1", "1e400", "nan", "inf", "true", "[]", "[1, 2]", '["a"]', "{}", "{ a = 1 }", '"x"', "''",
     '[{ name = "n", cron = "* * * * *", job_name = "a.b" }]', "[{}]", '[{"name": 1}]', "10:00", "1979-05-27"]
)  # fmt: skip
NAMES = st.one_of(
    st.sampled_from(VARIABLES),
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789", max_size=30).map(lambda tail: "DRAIN_" + tail),
)
VALUES = st.one_of(TOMLISH, st.text(max_size=60), TOMLISH.map(lambda v: f"[{v}, {v}]"))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(NAMES, VALUES, min_size=1, max_size=3))
def test_any_drain_variable_loads_or_is_a_one_line_error_naming_it(env: dict[str, str]) -> None:
    try:
        config.load(env=env)
    except errors.ConfigError as exc:
        assert "\n" not in str(exc) and "\r" not in str(exc)
        for problem in exc.problems:
            assert any(variable in problem for variable in env), problem


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"postgresql://u@h/db?sslmode=require&password={SECRET}&x=1", "postgresql://u@h/db?sslmode=require&password=***&x=1"),
        (f"host=db password='{SECRET} x' user=u", "host=db password=*** user=u"),
        (f"host=db sslpassword={SECRET}", "host=db sslpassword=***"),
        (f"redis://u:{SECRET}@[::1/0", "redis://***@[::1/0"),  # a netloc urlsplit refuses
        (f"amqp://a:{SECRET}@h1//;amqp://b:{SECRET}@h2//", "amqp://a:***@h1//;amqp://b:***@h2//"),
    ],
)  # fmt: skip
def test_redact_url_hides_query_and_quoted_passwords(text: str, shown: str) -> None:
    assert redaction.redact_url(text) == shown


def test_a_unicode_digit_port_is_one_line_not_a_crash() -> None:
    """'²'.isdigit() is true and int('²') raises: ports and db indexes are ASCII digits only."""
    with pytest.raises(errors.ConfigError, match=r"metrics\.listen"):
        config.load(None, env={"DRAIN_METRICS__LISTEN": ":\u00b2"})
