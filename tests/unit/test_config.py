"""Config: precedence, ${ENV} secrets, every problem reported at once, redaction."""

from __future__ import annotations

import pathlib

import pytest

from drain import config, errors
from drain.observability import redaction


def write(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "drain.toml"
    path.write_text(text)
    return path


def test_defaults_without_file() -> None:
    settings = config.load(env={})
    assert settings.table == "staged_jobs"
    assert settings.schema == "public"
    assert settings.batch_size == config.DEFAULT_BATCH_SIZE
    assert settings.backends == {}


def test_file_values_and_backends(tmp_path: pathlib.Path) -> None:
    path = write(
        tmp_path,
        """
dsn = "postgresql://drain@127.0.0.1/app"
batch_size = 200
[backends.default]
type = "rq"
url = "redis://127.0.0.1:6379/0"
max_attempts = 3
[metrics]
listen = ":9464"
""",
    )
    settings = config.load(path, env={})
    assert settings.batch_size == 200
    assert settings.backends["default"].type == "rq"
    assert settings.backends["default"].max_attempts == 3
    assert settings.backends["default"].options == {"url": "redis://127.0.0.1:6379/0"}
    assert settings.metrics_listen == "127.0.0.1:9464"


def test_precedence_flag_over_env_over_file(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, 'dsn = "postgresql://file/db"\ntable = "from_file"\nbatch_size = 10\n')
    env = {"DRAIN_DSN": "postgresql://env/db", "DRAIN_TABLE": "from_env"}
    settings = config.load(path, env=env, overrides={"table": "from_flag"})
    assert settings.dsn == "postgresql://env/db"
    assert settings.table == "from_flag"
    assert settings.batch_size == 10


def test_dsn_fallbacks_and_sqlalchemy_prefix() -> None:
    settings = config.load(env={"DATABASE_URL": "postgresql+psycopg://u@h/db"})
    assert settings.dsn == "postgresql://u@h/db"
    assert config.load(env={}).dsn == ""  # libpq's PG* variables take over


def test_config_from_environment_variable(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "batch_size = 7\n")
    assert config.load(env={"DRAIN_CONFIG": str(path)}).batch_size == 7


def test_env_substitution_for_secrets(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, '[backends.default]\ntype = "rq"\nurl = "redis://:${REDIS_PASSWORD}@h/0"\n')
    settings = config.load(path, env={"REDIS_PASSWORD": "s3cret"})
    assert settings.backends["default"].options["url"] == "redis://:s3cret@h/0"
    with pytest.raises(errors.ConfigError, match="REDIS_PASSWORD is not set"):
        config.load(path, env={})


def test_every_problem_reported_at_once(tmp_path: pathlib.Path) -> None:
    path = write(
        tmp_path,
        """
batch_size = "many"
tabel = "oops"
table = "bad-name"
poll_max_s = -1
[backends.default]
url = "redis://x"
[metrics]
listen = "nowhere"
""",
    )
    with pytest.raises(errors.ConfigError) as caught:
        config.load(path, env={})
    text = str(caught.value)
    for expected in (
        "batch_size: must be an integer",
        "tabel: unknown key",
        "table: must be letters",
        "poll_max_s: must be at least",
        "backends.default.type: is required",
        "metrics.listen: must be HOST:PORT",
    ):
        assert expected in text
    assert len(caught.value.problems) >= 6


def test_bad_toml_is_one_line(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "batch_size = [\n")
    with pytest.raises(errors.ConfigError, match="not valid TOML"):
        config.load(path, env={})
    with pytest.raises(errors.ConfigError, match="does not exist"):
        config.load(tmp_path / "missing.toml", env={})


def test_repr_and_redaction_hide_passwords() -> None:
    settings = config.Settings(dsn="postgresql://drain:hunter2@db/app")
    assert "hunter2" not in repr(settings)
    assert redaction.redact_url("amqp://user:guest@h:5672/%2F") == "amqp://user:***@h:5672/%2F"
    # a password is hidden wherever it stands: here the user is the password too
    assert redaction.redact_url("amqp://guest:guest@h:5672/%2F") == "amqp://***:***@h:5672/%2F"
    assert redaction.redact_url("host=db password=hunter2") == "host=db password=***"
    assert redaction.redact_url("redis://h/0") == "redis://h/0"


def test_shipped_config_files_are_valid() -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {"DRAIN_DSN": "postgresql://drain@db/app", "REDIS_URL": "redis://redis:6379/0"}
    for path in (root / "examples" / "drain.toml", root / "deploy" / "drain.example.toml"):
        settings = config.load(path, env=env)
        assert settings.backends["default"].type == "rq", path


def test_batch_max_bytes_from_file_and_environment(tmp_path: pathlib.Path) -> None:
    assert config.load(env={}).batch_max_bytes == config.BATCH_MAX_BYTES == 48 << 20
    path = write(tmp_path, "batch_max_bytes = 16777216\n")
    assert config.load(path, env={}).batch_max_bytes == 16 << 20
    loaded = config.load(path, env={"DRAIN_BATCH_MAX_BYTES": "33554432"})
    assert loaded.batch_max_bytes == 32 << 20
    assert loaded.sources["batch_max_bytes"] == "env DRAIN_BATCH_MAX_BYTES"
    for wrong, says in (("1000", "must be at least 1048576"), ('"64MiB"', "must be an integer")):
        with pytest.raises(errors.ConfigError, match=f"batch_max_bytes: {says}"):
            config.load(write(tmp_path, f"batch_max_bytes = {wrong}\n"), env={})


def test_pipeline_depth_from_file_and_environment(tmp_path: pathlib.Path) -> None:
    assert config.load(env={}).pipeline_depth == config.PIPELINE_DEPTH
    path = write(tmp_path, "pipeline_depth = 0\n")
    assert config.load(path, env={}).pipeline_depth == 0
    assert config.load(path, env={"DRAIN_PIPELINE_DEPTH": "2"}).pipeline_depth == 2
    with pytest.raises(errors.ConfigError, match="pipeline_depth: must be at least 0 and at most 16"):
        config.load(write(tmp_path, "pipeline_depth = 99\n"), env={})


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"watchdog_s": 0.5}, "watchdog_s: must be 0"),
        ({"watchdog_s": -1}, "watchdog_s: must be at least 0.0"),
        ({"watchdog_s": float("nan")}, "watchdog_s: must be a finite number"),
        ({"watchdog_s": float("inf")}, "watchdog_s: must be a finite number"),
        ({"watchdog_s": "soon"}, "watchdog_s: must be a finite number"),
        ({"statement_timeout_s": 0}, "statement_timeout_s: must be at least 0.1"),
        ({"publish_timeout_s": float("inf")}, "publish_timeout_s: must be a finite number"),
    ],
)
def test_worst_values_of_the_timing_keys_are_refused(data: dict[str, object], problem: str) -> None:
    with pytest.raises(errors.ConfigError) as caught:
        config.parse(data)
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems


def test_watchdog_bound_is_derived_from_the_timeouts_unless_set() -> None:
    derived = config.parse({})
    assert derived.watchdog_s is None
    assert derived.watchdog_bound_s() >= config.WATCHDOG_MIN_S
    slow = config.parse({"publish_timeout_s": 60, "statement_timeout_s": 120})
    assert slow.watchdog_bound_s() > 2 * (120 + 180)  # a healthy turn's worst case, twice
    assert config.parse({"watchdog_s": 5}).watchdog_bound_s() == 5.0
    assert config.load(env={"DRAIN_WATCHDOG_S": "7.5"}).watchdog_s == 7.5
    with pytest.raises(errors.ConfigError, match="watchdog_s"):
        config.load(env={"DRAIN_WATCHDOG_S": "later"})


@pytest.mark.parametrize("value", ['"yes"', "1", "0", '""', "[]", "{}"])
def test_block_on_dead_letter_takes_only_a_boolean(tmp_path: pathlib.Path, value: str) -> None:
    path = write(tmp_path, f'[backends.default]\ntype = "memory"\nblock_on_dead_letter = {value}\n')
    with pytest.raises(errors.ConfigError) as raised:
        config.load(path, env={})
    message = str(raised.value)
    assert "backends.default.block_on_dead_letter: must be true or false" in message
    assert message.count("\n") == 0


def test_block_on_dead_letter_is_the_cores_not_the_adapters(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, '[backends.default]\ntype = "memory"\nblock_on_dead_letter = true\n')
    settings = config.load(path, env={})
    assert settings.backends["default"].block_on_dead_letter is True
    assert "block_on_dead_letter" not in settings.backends["default"].options
    assert settings.dead_blocking() == ["default"]
    env = {"DRAIN_BACKENDS__DEFAULT__TYPE": "memory", "DRAIN_BACKENDS__DEFAULT__BLOCK_ON_DEAD_LETTER": "true"}
    assert config.load(env=env).dead_blocking() == ["default"]
