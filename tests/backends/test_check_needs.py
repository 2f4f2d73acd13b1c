"""``drain check`` finds what the drain needs on its brokers and is missing (issue 33).

It used to prove only that a broker takes a publish. Now each backend says what it needs and
does not find, every problem at once, one line each, no secret: RabbitMQ's ``queues`` (a deleted
queue made every row of it unroutable), RQ's ``rq:queues`` a set and the job keys, queue keys
and ``rq:queues`` writable by the drain's Redis user, Celery on Redis its default queue's list.
Against a private redis-server (an ACL user of its own) and the shared RabbitMQ.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from drain_adapters import celery, rabbitmq, rq

from drain import backend
from tests.support import configs, processes, rabbit, redis_server

USER, PASSWORD = "drain_check", "check-test-password"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis_server.RedisServer]:
    with redis_server.running(tmp_path_factory.mktemp("redis"), appendonly=False) as private:
        yield private


@pytest.fixture
def user_url(server: redis_server.RedisServer) -> Iterator[str]:
    """A Redis user that may write only ``rq:job:*`` and ``celery*``: not rq:queues nor queue keys."""
    admin = server.client()
    admin.execute_command(
        "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}", "~rq:job:*", "~celery*", "+@all"
    )
    try:
        yield f"redis://{USER}:{PASSWORD}@127.0.0.1:{server.port}/0"
    finally:
        admin.execute_command("ACL", "DELUSER", USER)


def problems(adapter: backend.Adapter) -> list[str]:
    assert isinstance(adapter, backend.CheckedAdapter)
    adapter.open()
    try:
        return adapter.problems()
    finally:
        adapter.close()


def test_rq_finds_nothing_missing_on_a_fresh_redis(server: redis_server.RedisServer) -> None:
    adapter = rq.RQAdapter.from_options(
        "b", {"url": server.url, "allowed_jobs": ["json.dumps"]}, publish_timeout_s=5
    )
    assert problems(adapter) == []
    assert server.client().keys("*") == []  # the probes wrote nothing


def test_rq_names_every_key_it_may_not_write_and_a_wrong_type_registry(
    server: redis_server.RedisServer, user_url: str
) -> None:
    adapter = rq.RQAdapter.from_options(
        "b", {"url": user_url, "allowed_jobs": ["json.dumps"]}, publish_timeout_s=5
    )
    found = problems(adapter)
    assert any("'rq:queues'" in line and "NOPERM" in line for line in found), found
    assert any("'rq:queue:" in line and "NOPERM" in line for line in found), found
    assert any("script" in line for line in found), found
    assert not any("rq:job:" in line for line in found), found
    assert all("\n" not in line and PASSWORD not in line for line in found), found
    server.client().set("rq:queues", "a string")
    try:
        admin_view = rq.RQAdapter.from_options(
            "b", {"url": server.url, "allowed_jobs": ["json.dumps"]}, publish_timeout_s=5
        )
        assert problems(admin_view) == ["the Redis key 'rq:queues' is a string, not a set"]
    finally:
        server.client().delete("rq:queues")


def test_celery_on_redis_names_a_default_queue_it_may_not_write(
    server: redis_server.RedisServer, user_url: str
) -> None:
    options = {"broker_url": server.url, "allowed_jobs": ["app.*"]}
    assert problems(celery.CeleryAdapter.from_options("c", options, publish_timeout_s=5)) == []
    server.client().set("celery", "a string")
    try:
        found = problems(celery.CeleryAdapter.from_options("c", options, publish_timeout_s=5))
        assert found == ["the Redis key 'celery' is a string, not a list"]
    finally:
        server.client().delete("celery")
    locked_out = {"broker_url": user_url.replace(USER, USER), "allowed_jobs": ["app.*"]}
    server.client().execute_command("ACL", "SETUSER", USER, "resetkeys", "~rq:*")
    found = problems(celery.CeleryAdapter.from_options("c", locked_out, publish_timeout_s=5))
    assert len(found) == 1 and "'celery'" in found[0] and "NOPERM" in found[0], found


def test_rabbitmq_names_each_missing_queue_and_the_cli_says_every_problem(
    server: redis_server.RedisServer, database: str, tmp_path: Path
) -> None:
    present, gone, also_gone = (rabbit.unique_name("check") for _ in range(3))
    with rabbit.queues(rabbit.SHARED_URL, present):
        options = {"url": rabbit.SHARED_URL, "queues": [present, gone, also_gone]}
        found = problems(rabbitmq.RabbitMQAdapter.from_options("r", options, publish_timeout_s=5))
        assert [line.split("'")[1] for line in found] == [gone, also_gone], found
        assert all("NOT_FOUND" in line or "404" in line for line in found), found

        server.client().set("rq:queues", "a string")
        try:
            backends = {
                "r": configs.rabbitmq(rabbit.SHARED_URL, queues=[present, gone]),
                "q": configs.rq(server.url),
            }
            config = configs.write_config(tmp_path / "drain.toml", database, backends)
            done = processes.drain_cli("check", "--config", str(config), dsn=database)
        finally:
            server.client().delete("rq:queues")
    said = done.stderr.splitlines()
    assert done.returncode != 0, done.stderr
    assert any(f"backend r: queue '{gone}'" in line for line in said), done.stderr
    assert any("backend q: the Redis key 'rq:queues' is a string" in line for line in said), done.stderr
