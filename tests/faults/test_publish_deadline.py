"""A hung backend never holds the batch transaction open (reliability: bound the batch).

The RQ backend's Redis is reached through a loopback proxy that can stall: it keeps accepting
and reading but never answers. While it stalls, every batch must end within the publish deadline
(the adapter's socket timeout, from ``publish_timeout_s``): the drain's session is sampled in
pg_stat_activity and its transaction age must stay below ``idle_in_transaction_session_timeout``
(which would otherwise end the session and the leadership). The drain keeps its session, no row
is touched or dead-lettered, and once a good backend is configured every job reaches Redis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import selectors
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import redis
import rq

import drain
from drain import backend, config
from drain.relay import loop as relay
from drain.store import session as store
from tests.support.waiting import steps_until, wait_until

PUBLISH_TIMEOUT_S = 1.0
DEADLINE_S = 90.0
STALLED_ATTEMPTS = 2


class StallingProxy:
    """A TCP proxy to ``target``; with ``stalled`` set it swallows bytes and never answers."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.stalled = threading.Event()
        self.accepted_while_stalled = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, None)
        while not self._closing.is_set():
            for key, _ in selector.select(timeout=0.1):
                if key.data is None:
                    client, _ = self._listener.accept()
                    self._sockets.append(client)
                    if self.stalled.is_set():
                        self.accepted_while_stalled += 1
                        selector.register(client, selectors.EVENT_READ, "swallow")
                        continue
                    server = socket.create_connection(self.target)
                    self._sockets.append(server)
                    selector.register(client, selectors.EVENT_READ, server)
                    selector.register(server, selectors.EVENT_READ, client)
                    continue
                source: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    data = source.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    selector.unregister(source)
                    source.close()
                    continue
                if key.data != "swallow" and not self.stalled.is_set():
                    key.data.sendall(data)
        selector.close()

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=10)
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.fixture
def proxy(redis_db: str) -> Iterator[StallingProxy]:
    the_proxy = StallingProxy(("127.0.0.1", 6379))
    yield the_proxy
    the_proxy.close()


def rq_settings(settings: config.Settings, url: str) -> config.Settings:
    return dataclasses.replace(
        settings,
        publish_timeout_s=PUBLISH_TIMEOUT_S,
        backends={
            "default": config.BackendSettings(
                "default", "rq", 3, {"url": url, "allowed_jobs": ["app.tasks.ok"]}
            )
        },
    )


def stage(database: str, queue: str, count: int) -> list[uuid.UUID]:
    with psycopg.connect(database) as conn:
        return drain.stage_many(
            conn, [drain.Job("app.tasks.ok", args=[n], queue=queue) for n in range(count)]
        )


def scalar(conn: psycopg.Connection[tuple[object, ...]], query: str) -> object:
    row = conn.execute(query).fetchone()  # type: ignore[arg-type]
    assert row is not None
    return row[0]


def test_a_hung_backend_rolls_the_batch_back_within_the_deadline(
    settings: config.Settings, database: str, redis_db: str, proxy: StallingProxy
) -> None:
    queue = f"drain-deadline-{uuid.uuid4().hex[:8]}"
    db_index = redis_db.rsplit("/", 1)[1]
    settings = rq_settings(settings, f"redis://127.0.0.1:{proxy.port}/{db_index}")
    fence_s = store.idle_in_transaction_timeout_ms(PUBLISH_TIMEOUT_S) / 1000
    before = stage(database, queue, 10)
    the_relay = relay.Relay(settings, backend.build_adapters(settings.backends, PUBLISH_TIMEOUT_S))
    stop = threading.Event()
    runner = threading.Thread(target=the_relay.run, args=(stop,), daemon=True)
    runner.start()
    oldest_xact_s = 0.0
    try:
        with psycopg.connect(database, autocommit=True) as watcher:
            deadline = time.monotonic() + DEADLINE_S  # for both phases
            wait_until(
                "the healthy phase to drain",
                lambda: not scalar(watcher, "SELECT count(*) FROM staged_jobs"),
                deadline - time.monotonic(),
            )
            leader_pid = the_relay.leadership.pid
            assert leader_pid is not None

            proxy.stalled.set()
            after = stage(database, queue, 10)
            while proxy.accepted_while_stalled < STALLED_ATTEMPTS:  # each one: a hung batch, rolled back
                assert time.monotonic() < deadline, "the drain never retried the stalled backend"
                age = scalar(
                    watcher,
                    "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)), 0)::float8 "
                    "FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name LIKE 'drain/%' AND xact_start IS NOT NULL",
                )
                oldest_xact_s = max(oldest_xact_s, float(age))  # type: ignore[arg-type]
                time.sleep(0.05)
            assert the_relay.leadership.pid == leader_pid  # the session survived: never fenced
            assert scalar(watcher, "SELECT count(*) FROM staged_jobs WHERE attempts > 0") == 0
            assert scalar(watcher, "SELECT count(*) FROM staged_jobs_dead") == 0
    finally:
        stop.set()
        runner.join(timeout=60)
    assert not runner.is_alive()
    print(f"longest batch transaction while the backend hung: {oldest_xact_s:.2f}s (fence {fence_s:.0f}s)")
    # The publish deadline bounds the batch (the rest: one select and a rollback), far below the
    # fence that would end the session.
    assert oldest_xact_s < PUBLISH_TIMEOUT_S + 0.5 < fence_s

    good = rq_settings(settings, redis_db)
    healed = relay.Relay(good, backend.build_adapters(good.backends, PUBLISH_TIMEOUT_S))
    try:
        assert healed.leadership.try_acquire()
        steps_until(healed.drain_once, lambda report: not report.selected, "draining the table")
    finally:
        healed.shutdown()
    client = redis.Redis.from_url(redis_db)
    try:
        assert sorted(rq.Queue(queue, connection=client).job_ids) == sorted(str(i) for i in before + after)
    finally:
        client.close()
