"""Redis error replies (drain_adapters.redis.errors): only WRONGTYPE is evidence, whatever the wording.

Each reply is checked in the three shapes the adapters meet it in: the raw text (a script's or
a transaction's reply for one job), the exception redis-py's parser makes of it (it strips the
code of the errors it maps to its own classes), and that exception annotated by a pipeline.
"""

from __future__ import annotations

import hypothesis
import pytest
import redis
from drain_adapters.redis import errors as redis_errors
from hypothesis import strategies as st
from redis._parsers.base import BaseParser
from redis.sentinel import MasterNotFoundError

from drain import errors

SERVER_REPLIES = [
    "READONLY You can't write against a read only replica.",
    "OOM command not allowed when used memory > 'maxmemory'.",
    "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
    "LOADING Redis is loading the dataset in memory",
    "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "NOREPLICAS Not enough good replicas to write.",
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "CLUSTERDOWN The cluster is down",
    "MOVED 3999 127.0.0.1:6381",
    "ASK 3999 127.0.0.1:6381",
    "CROSSSLOT Keys in request don't hash to the same slot",
    "NOAUTH Authentication required.",
    "WRONGPASS invalid username-password pair or user is disabled.",
    "NOPERM this user has no permissions to run the 'evalsha' command",
    "NOPERM User drain has no permissions to run the 'lpush' command",
    "NOSCRIPT No matching script. Please use EVAL.",
    "EXECABORT Transaction discarded because of previous errors.",
    "UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)",
    "DENIED Redis is running in protected mode because protected mode is enabled",
]
JOB_REPLIES = [
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "NOPERM this user has no permissions to access one of the keys used as arguments",
    "NOPERM No permissions to access a key",
    "NOPERM this user has no permissions to access one of the channels used as arguments",
]
SCRIPT_SERVER_REPLIES = [  # the same refusals worded with the generic ERR code inside a script
    "ERR The user executing the script can't run this command or subcommand",
    "ERR The user executing the script can't run this command or subcommand script: f, on @user_script:1.",
    "ERR The user executing the script is lacking the permissions for the command",
    "ERR ACL failure in script: User drain has no permissions to run the 'rpush' command",
    "ERR ACL failure in script: User keymaster has no permissions to run the 'hset' command script: f",
    "ERR ACL failure in script: No permissions to access database",
    "ERR Unknown Redis command called from script",
    "ERR Unknown Redis command called from Lua script",
    "ERR This Redis command is not allowed from script",
    "ERR This Redis command is not allowed from scripts",
    "ERR Write commands are not allowed from read-only scripts.",
    "ERR Error running script (call to f_1): @user_script:1: @user_script: 1: -OOM command not allowed",
    "ERR Error running script (call to f_1): @user_script:9: READONLY You can't write against a replica.",
    "ERR Error running script (call to f_1): @user_script:9: NOREPLICAS Not enough good replicas to write.",
    "The user executing the script can't run this command or subcommand",  # no code at all (Redis 6)
]
SCRIPT_JOB_REPLIES = [
    "ERR The user executing the script can't access at least one of the keys mentioned in the command",
    "ERR The user executing the script can't publish to the channel mentioned in the command",
    "ERR ACL failure in script: User drain has no permissions to access the 'rq:queue:x' key",
    "ERR ACL failure in script: No permissions to access a key",
    "ERR ACL failure in script: User drain has no permissions to access the 'c' channel",
    "ERR Error running script (call to f_1): @user_script:9: WRONGTYPE Operation against a key holding",
]
UNKNOWN_REPLIES = [
    "ERR value is not an integer or out of range",
    "ERR invalid expire time in 'expire' command",
    "ERR Error running script (call to f_0123): @user_script:1: oops",
    "Script killed by user with SCRIPT KILL",
    "ERR Wrong number of args calling Redis command from script",
    "ERR Error running script (call to f_1): @user_script:9: ERR value is not an integer or out of range",
    "ERR Error running script (call to f_1): @user_script:9: attempt to compare a nil value (OOM test)",
    "lowercase text with no code",
    "",
]


def shapes(text: str) -> list[str | BaseException]:
    parsed = BaseParser.parse_error(text)
    annotated = BaseParser.parse_error(text)
    quote = 'Command # 1 (LPUSH emails {"body": "c2VjcmV0"}) of pipeline caused error: '
    annotated.args = (f"{quote}{annotated}",)
    return [text, parsed, annotated]


EVERY_REPLY = SERVER_REPLIES + JOB_REPLIES + SCRIPT_SERVER_REPLIES + SCRIPT_JOB_REPLIES + UNKNOWN_REPLIES


@pytest.mark.parametrize("text", EVERY_REPLY)
def test_only_a_wrongtype_code_is_evidence_against_a_key(text: str) -> None:
    for shape in shapes(text):
        assert redis_errors.wrong_type(shape) is text.startswith("WRONGTYPE "), repr(shape)


@pytest.mark.parametrize("text", SERVER_REPLIES)
def test_the_reason_keeps_the_code_redis_py_strips(text: str) -> None:
    for shape in shapes(text):
        assert redis_errors.reason(shape).startswith(text.split(maxsplit=1)[0]), repr(shape)


@hypothesis.given(text=st.text(max_size=300))
def test_no_error_text_is_evidence_unless_it_is_wrongtype(text: str) -> None:
    """Issue 33: an ACL refusal naming a key (NOPERM ... key) or any unknown text used to be
    taken for the job's own and dead-lettered it; no wording may do that now."""
    for shape in shapes(text):
        expected = redis_errors.code(shape) == "WRONGTYPE"
        assert redis_errors.wrong_type(shape) is expected
        caught = raised_through_translated(BaseParser.parse_error(text))
        assert isinstance(caught, errors.BackendUnavailable)
        assert "\n" not in str(caught)


def test_the_reason_is_one_bounded_line_without_the_pipelines_quote_of_the_payload() -> None:
    (_text, _parsed, annotated) = shapes("OOM command not allowed when used memory > 'maxmemory'.\nmore")
    reason = redis_errors.reason(annotated)
    assert reason == "OOM command not allowed when used memory > 'maxmemory'."
    assert len(redis_errors.reason("ERR " + "x" * 5000)) == redis_errors.MAX_REASON_CHARS


def raised_through_translated(exc: BaseException) -> BaseException:
    try:
        with redis_errors.translated("redis backend b"):
            raise exc
    except BaseException as caught:
        return caught
    raise AssertionError("nothing raised")


@pytest.mark.parametrize(
    "exc",
    [
        redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."),
        redis.TimeoutError("Timeout reading from socket"),
        MasterNotFoundError("No master found for 'm' : <redis.client.Redis(<...(password=<REDACTED>)>)> - x"),
        BaseParser.parse_error("LOADING Redis is loading the dataset in memory"),  # a ConnectionError
        BaseParser.parse_error("WRONGPASS invalid username-password pair or user is disabled."),
        BaseParser.parse_error("READONLY You can't write against a read only replica."),
        BaseParser.parse_error("BUSY Redis is busy running a script."),
        BaseParser.parse_error("ERR something nobody can pin on a job"),
    ],
)
def test_a_whole_call_failing_for_the_server_or_unknown_is_unavailable(exc: BaseException) -> None:
    caught = raised_through_translated(exc)
    assert isinstance(caught, errors.BackendUnavailable)
    assert str(caught).startswith("redis backend b")
    assert "\n" not in str(caught)
    assert "<redis." not in str(caught)


@pytest.mark.parametrize("text", EVERY_REPLY)
def test_every_refusal_of_a_whole_call_is_unavailable(text: str) -> None:
    """An ACL refusal of one key used to propagate for the relay's one-by-one net, which then
    rejected every row (issue 33): a whole call's error names no row."""
    caught = raised_through_translated(BaseParser.parse_error(text))
    assert isinstance(caught, errors.BackendUnavailable), repr(caught)
