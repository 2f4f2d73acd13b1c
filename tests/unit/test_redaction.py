"""drain.observability.redaction: the one place passwords are hidden (the logs', the config's and the
adapters' redaction all call it). Its URL and log cases are in test_logs.py, test_config*.py and
test_redis_settings.py; these are the parts only it has."""

from __future__ import annotations

import dataclasses

from drain.observability import redaction
from tests.unit.test_app_imports import loaded_by


def test_it_imports_nothing_heavy() -> None:
    """The adapters and the app side may import it: it brings no other module of drain's than
    ``import drain`` does, and none of the config, the logs' JSON library or the metrics."""
    extra = set(loaded_by("import drain.observability.redaction")) - set(loaded_by("import drain"))
    assert {name for name in extra if name.startswith("drain")} == {"drain.observability.redaction"}
    assert not {"prometheus_client", "pythonjsonlogger", "tomllib", "cronsim"} & extra


def test_a_secret_the_caller_names_is_hidden_even_bare() -> None:
    text = "connection refused for guest (password hunter2) at amqp://guest:hunter2@h/"
    assert redaction.redact(text, secrets=["hunter2", ""]) == (
        "connection refused for guest (password ***) at amqp://guest:***@h/"
    )


def test_a_value_shown_hides_urls_and_whole_values_of_secret_keys() -> None:
    value = {
        "url": "redis://:pw@h/0",
        "nested": {"auth_token": "t0k3n", "hosts": ["amqp://u:p@a/", "amqp://b/"]},
        "api_key": ["k1", "k2"],
        "monkey": "not a secret",
    }
    assert redaction.masked(value) == {
        "url": "redis://:***@h/0",
        "nested": {"auth_token": "***", "hosts": ["amqp://u:***@a/", "amqp://b/"]},
        "api_key": "***",
        "monkey": "not a secret",
    }
    assert redaction.is_secret_name("sentinel_password")
    assert not redaction.is_secret_name("keyspace")
    assert not redaction.is_secret_name("routing_key")  # the RabbitMQ backend's: "queue" or "ordering_key"
    assert redaction.is_secret_name("routing_key_secret")


def test_a_settings_repr_redacts_its_url_field_and_keeps_the_rest() -> None:
    @dataclasses.dataclass(frozen=True)
    class Target:
        url: str
        timeout_s: float = 1.0
        hidden: str = dataclasses.field(default="x", repr=False)

    shown = redaction.redacted_repr(Target("amqp://u:secret@h/;amqp://u:other@i/"), "url")
    assert shown == "Target(url='amqp://u:***@h/;amqp://u:***@i/', timeout_s=1.0)"


def test_a_log_field_is_redacted_however_nested() -> None:
    field = {"urls": ("redis://:pw@h/0", 5, None), "error": ValueError("password=hunter2")}
    assert redaction.redact_value(field) == {"urls": ("redis://:***@h/0", 5, None), "error": "password=***"}
