"""The one classification of Redis error replies (drain_adapters.redis.errors), over every code.

Each reply is checked in the three shapes the adapters meet it in: the raw text (a script's or
a transaction's reply for one job), the exception redis-py's parser makes of it (it strips the
code of the errors it maps to its own classes), and that exception annotated by a pipeline.
"""

from __future__ import annotations

import pytest
import redis
from drain_adapters.redis import errors as redis_errors
from drain_adapters.redis.errors import Scope
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


def test_every_code_the_drain_knows_of_is_in_the_table() -> None:
    codes = {text.split()[0] for text in SERVER_REPLIES + JOB_REPLIES}
    assert codes == redis_errors.SERVER_CODES | redis_errors.JOB_CODES


@pytest.mark.parametrize("text", SERVER_REPLIES)
def test_a_refusal_of_the_whole_server_is_server_scope(text: str) -> None:
    for shape in shapes(text):
        assert redis_errors.scope(shape) is Scope.SERVER, repr(shape)
        assert redis_errors.reason(shape).startswith(text.split(maxsplit=1)[0]), repr(shape)


@pytest.mark.parametrize("text", JOB_REPLIES)
def test_a_refusal_of_one_jobs_keys_is_job_scope(text: str) -> None:
    for shape in shapes(text):
        assert redis_errors.scope(shape) is Scope.JOB, repr(shape)


@pytest.mark.parametrize("text", SCRIPT_SERVER_REPLIES)
def test_a_refusal_of_the_whole_server_worded_as_err_inside_a_script_is_server_scope(text: str) -> None:
    for shape in shapes(text):
        assert redis_errors.scope(shape) is Scope.SERVER, repr(shape)


@pytest.mark.parametrize("text", SCRIPT_JOB_REPLIES)
def test_an_acl_refusal_of_one_jobs_key_worded_as_err_inside_a_script_is_job_scope(text: str) -> None:
    for shape in shapes(text):
        assert redis_errors.scope(shape) is Scope.JOB, repr(shape)


def test_a_command_refusal_is_the_servers_whatever_the_user_is_called() -> None:
    text = "NOPERM User keys_and_channels has no permissions to run the 'rpush' command"
    assert redis_errors.scope(text) is Scope.SERVER


@pytest.mark.parametrize("text", UNKNOWN_REPLIES)
def test_anything_else_is_unknown(text: str) -> None:
    for shape in shapes(text):
        assert redis_errors.scope(shape) is Scope.UNKNOWN, repr(shape)


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


def test_a_whole_call_refused_for_one_jobs_key_reaches_the_relays_one_by_one_net() -> None:
    exc = BaseParser.parse_error(JOB_REPLIES[1])
    caught = raised_through_translated(exc)
    assert caught is exc
    assert not isinstance(caught, errors.BackendUnavailable)
