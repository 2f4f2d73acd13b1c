"""drain.observability.redaction: the one place passwords are hidden (the logs', the config's and the
adapters' redaction all call it). Its URL and log cases are in test_logs.py, test_config*.py and
test_redis_settings.py; these are the parts only it has."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

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


def test_fragments_are_every_piece_of_a_password_the_text_holds() -> None:
    """Found by the text alone (no library parses these), longest first, each of 4+ characters."""
    url = redaction.fragments("postgresql://u:pa/ssw@rd%zz word@host/db")
    assert url[0] == "pa/ssw@rd%zz word" and {"ssw", "word"} & set(url) == {"word"}
    assert {"rd%zz", "word"} <= set(url)  # pieces between delimiters and spaces
    assert "p@ss" in redaction.fragments("postgresql://u:p%40ss@h/db")  # percent-decoded
    pairs = redaction.fragments("host=h password=two words dbname=x")
    assert pairs == ["two words", "words"]  # unquoted: up to the next key=
    quoted = redaction.fragments(r"host=h password='it\'s here' dbname=x")
    assert "it's here" in quoted and "here" in quoted
    assert redaction.fragments("host=h dbname=x") == []


def test_hidden_secrets_are_hidden_from_every_redact_until_replaced() -> None:
    try:
        redaction.hide(["Hunter2pieces"])
        assert redaction.redact("libpq said: Hunter2pieces") == "libpq said: ***"
        redaction.hide([])
        assert redaction.redact("libpq said: Hunter2pieces") == "libpq said: Hunter2pieces"
    finally:
        redaction.hide([])


@pytest.mark.parametrize(
    "name", ["apiKey", "apikey", "api-key", "X-Api-Key", "Cookie", "Set-Cookie", "signingKey"]
)
def test_common_spellings_of_a_secret_key_are_secret_names(name: str) -> None:
    assert redaction.is_secret_name(name)


@pytest.mark.parametrize(
    "name", ["routing_key", "ordering_key", "monkey", "keyspace", "keyboard", "key", "turkey_count", "queue"]
)
def test_plain_names_stay_plain(name: str) -> None:
    assert not redaction.is_secret_name(name)


def test_a_term_holding_a_hidden_secret_is_told_and_a_piece_of_one_is_not() -> None:
    """A filter's term that holds one of the hidden secrets, in any case, is told: searching it
    would find only what redact hides. A piece of one is not: that such a term found nothing
    where the page shows it would spell the secret out, a piece at a time."""
    redaction.hide(["Sup3rDbPassw0rd"])
    try:
        assert redaction.hidden_by_term("sup3rdbpassw0rd and more")
        assert redaction.hidden_by_term("tried SUP3RDBPASSW0RD")
        assert not redaction.hidden_by_term("Sup3rDbP")
        assert not redaction.hidden_by_term("a")
        assert not redaction.hidden_by_term("login failed")
        assert not redaction.hidden_by_term("")
    finally:
        redaction.hide(())
    assert not redaction.hidden_by_term("Sup3rDbPassw0rd")


@pytest.mark.parametrize(
    "name",
    ["db_pwd", "PWD", "privkey", "private-key", "jwt", "sessionid", "Authorization", "x_signature"],
)
def test_a_secret_name_is_found_whatever_its_case_and_separators(name: str) -> None:
    assert redaction.is_secret_name(name)


def test_keys_are_masked_and_two_masked_alike_are_both_kept() -> None:
    value = {"amqp://u:one@h/": 1, "amqp://u:two@h/": 2, "amqp://u:***@h/*": 3, "plain": 4}
    assert redaction.masked(value) == {
        "amqp://u:***@h/": 1,
        "amqp://u:***@h/*": 2,
        "amqp://u:***@h/**": 3,
        "plain": 4,
    }


def test_every_url_in_a_string_loses_its_password_and_an_odbc_pwd_its_value() -> None:
    assert redaction.masked("see https://a:pw1@h/x failed") == "see https://a:***@h/x failed"
    assert redaction.masked("[redis://:k3y@c:6379/0]") == "[redis://:***@c:6379/0]"
    assert redaction.masked("Server=db;Uid=app;Pwd=hunter2;") == "Server=db;Uid=app;Pwd=***"
    assert "hunter2" not in redaction.masked("db at https://h/x; Uid=app;Pwd=hunter2;")
    assert redaction.redact("login failed: Server=db;PWD=hunter2") == "login failed: Server=db;PWD=***"


def test_a_log_field_keyed_by_a_url_hides_its_password() -> None:
    assert redaction.redact_value({"redis://:pw@h/0": "down"}) == {"redis://:***@h/0": "down"}


@given(st.text(alphabet="abcdeghijklnoprstuwyzAPIKSX_-. 0", max_size=24))
def test_the_consoles_sql_words_cover_every_name_python_masks(name: str) -> None:
    """The console's SQL decides a row by SECRET_WORDS when none is in it (the page then shows its
    stored text): every name Python masks must hold one of them, or a filter would find a masked
    value. Hypothesis draws names from the letters the secret words are made of."""
    normal = re.sub(redaction.NORMAL_DROP, "", name.lower())
    if redaction.is_secret_name(name):
        assert re.search(redaction.SECRET_WORDS, normal), name


@pytest.mark.parametrize("name", ["sessid", "x_auth", "Authorization", "db_pwd", "session", "jwt"])
def test_each_secret_name_is_among_the_consoles_sql_words(name: str) -> None:
    normal = re.sub(redaction.NORMAL_DROP, "", name.lower())
    assert redaction.is_secret_name(name) and re.search(redaction.SECRET_WORDS, normal)


def test_a_secret_cut_off_at_the_end_of_a_text_is_hidden() -> None:
    redaction.hide(["Sup3rDbPassw0rd"])
    try:
        assert redaction.redact_cut("login failed for Sup3rDbPa") == "login failed for ***"
        assert redaction.redact_cut("tried Sup3rDbPassw0rd, then S") == "tried ***, then ***"
        assert redaction.redact_cut("nothing of it") == "nothing of it"
        assert redaction.redact("login failed for Sup3rDbPa") == "login failed for Sup3rDbPa"
    finally:
        redaction.hide(())
