"""The batch's script call, packed by the adapter (rq_script.command) rather than by redis-py.

Byte for byte what redis-py would send for the same arguments, whatever the values hold; and a
Redis that does not know the script (restarted, failed over: SCRIPT FLUSH here, on a private
server) is given it and the batch goes through.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from drain_adapters.rq import adapter as rq_adapter
from drain_adapters.rq import message as rq_message
from drain_adapters.rq import script as rq_script
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.connection import HiredisRespSerializer, PythonRespSerializer

from drain import models
from tests.support import jobs, redis_server

values = st.binary(max_size=300) | st.sampled_from([b"", b"\r\n", b"$5\r\n", b"*1\r\n", b"\x00" * 3])
messages = st.builds(
    rq_message.RQMessage,
    job_key=values,
    job_id=values,
    queue_key=values,
    fields=st.dictionaries(values, values, max_size=20),
    ttl=st.none() | st.integers(min_value=0, max_value=10**20),
    at_front=st.booleans(),
    mark=values,
)


def redis_py_bytes(batch: list[rq_message.RQMessage], serializer: object) -> bytes:
    keys, argv = rq_script.arguments(batch)
    packed = serializer.pack("EVALSHA", rq_script.SHA, len(keys), *keys, *argv)  # type: ignore[attr-defined]
    return b"".join(packed)


@settings(max_examples=300, deadline=None)
@given(st.lists(messages, max_size=6))
def test_the_command_is_what_redis_py_packs(batch: list[rq_message.RQMessage]) -> None:
    ours = rq_script.command(batch)
    assert ours == redis_py_bytes(batch, HiredisRespSerializer())
    encoder = redis.connection.Encoder("utf-8", "strict", decode_responses=False)
    assert ours == redis_py_bytes(batch, PythonRespSerializer(6000, encoder.encode))


def test_the_sha_is_the_one_redis_computes(redis_db: str) -> None:
    client = redis.Redis.from_url(redis_db)
    try:
        assert client.script_load(rq_script.SCRIPT).encode() == rq_script.SHA
    finally:
        client.close()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[redis_server.RedisServer]:
    with redis_server.running(tmp_path / "redis", appendonly=False) as server:
        yield server


def test_a_redis_that_forgot_the_script_is_given_it_again(private_redis: redis_server.RedisServer) -> None:
    adapter = rq_adapter.RQAdapter.from_options(
        "default", {"url": private_redis.url, "allowed_jobs": ["json.dumps"]}, publish_timeout_s=5
    )
    adapter.open()
    client = private_redis.client()
    try:
        first = adapter.publish_batch([jobs.staged(1, "script-q")])
        assert [result.outcome for result in first] == [models.Outcome.PUBLISHED]
        client.script_flush()  # what a restart or a failover to a replica that never ran it does
        assert client.script_exists(rq_script.SHA.decode()) == [False]
        second = adapter.publish_batch([jobs.staged(2, "script-q"), jobs.staged(3, "script-q")])
        assert [result.outcome for result in second] == [models.Outcome.PUBLISHED] * 2
        assert client.llen("rq:queue:script-q") == 3
    finally:
        adapter.close()
        client.close()
