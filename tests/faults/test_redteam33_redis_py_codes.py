"""Red team 33: a whole-server refusal inside the RQ script is an outage whatever redis-py names it (G6, G10).

``drain_adapters.redis.errors.scope`` read a refusal's code from ``status_code``, which redis-py
sets only since 7.4: earlier releases (the ``rq`` extra admits ``redis>=5.3``, ``celery``
``redis>=5``) strip the code of the errors they map to a class of their own (``READONLY``,
``OOM``, ``LOADING``, ``NOSCRIPT``, ``EXECABORT``, ``NOPERM``) and keep only the class. With one
of them, a replica's or a full server's refusal of the script's writes was Scope.UNKNOWN, and in
the script's reply for one job that is the job's rejection: the row was retried and then
dead-lettered while Redis refused everything. G10: "Whole-backend refusals (Redis
READONLY/OOM/MISCONF) are outages, never rejections"; G6: "A broker outage never dead-letters
anything".

Against a real Redis, made a replica (READONLY) or full (OOM) by tests.support.redis_refusals,
with redis-py's parser giving the errors as redis-py 5.3 to 7.3 do (the class, no code).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from drain_adapters.redis import errors as redis_errors
from drain_adapters.rq import adapter as rq_adapter
from redis._parsers.base import BaseParser

from drain import errors
from tests.support import jobs, redis_refusals, redis_server


def parse_error_without_code(cls: Any, response: str) -> redis.ResponseError:
    """``BaseParser.parse_error`` as redis-py 5.3 to 7.3 have it: no ``status_code``."""
    error_code = response.split(" ", maxsplit=1)[0]
    if error_code in cls.EXCEPTION_CLASSES:
        response = response[len(error_code) + 1 :]
        exception_class = cls.EXCEPTION_CLASSES[error_code]
        if isinstance(exception_class, dict):
            exception_class = exception_class.get(response, redis.ResponseError)
        error: redis.ResponseError = exception_class(response)
        return error
    return redis.ResponseError(response)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), "READONLY"),
        (redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), "OOM"),
        (redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"), "LOADING"),
        (redis.exceptions.NoScriptError("No matching script. Please use EVAL."), "NOSCRIPT"),
        (redis.exceptions.ExecAbortError("Transaction discarded because of previous errors."), "EXECABORT"),
    ],
)
def test_a_server_refusal_without_its_code_is_the_servers(error: redis.ResponseError, code: str) -> None:
    assert redis_errors.code(error) == code
    assert not redis_errors.wrong_type(error)
    assert redis_errors.reason(error).startswith(code + " ")


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[redis_server.RedisServer]:
    with redis_server.running(tmp_path, appendonly=False) as server:
        yield server


SERVER_WIDE = [refusal for refusal in redis_refusals.REFUSALS if refusal.code in ("READONLY", "OOM")]


@pytest.mark.parametrize("refusal", SERVER_WIDE, ids=lambda refusal: refusal.code)
def test_a_refusing_server_is_an_outage_with_an_older_redis_py(
    private_redis: redis_server.RedisServer, refusal: redis_refusals.Refusal, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(BaseParser, "parse_error", classmethod(parse_error_without_code))
    adapter = rq_adapter.RQAdapter.from_options(
        "default", {"url": private_redis.url, "allowed_jobs": ["json.dumps"]}, publish_timeout_s=5
    )
    adapter.open()
    heal = refusal.inject(private_redis)
    try:
        with pytest.raises(errors.BackendUnavailable, match=refusal.code):
            results = adapter.publish_batch([jobs.staged(1, "rt33-codes"), jobs.staged(2, "rt33-codes")])
            pytest.fail(f"{refusal.code}: the rows were not kept for the outage: {results}")
    finally:
        heal()
        adapter.close()
