"""Make a private redis-server refuse every write, the ways production Redis does, and heal it.

Each :class:`Refusal` puts the server in one state and returns the function that ends it:

- READONLY: a replica (``REPLICAOF`` a master that does not exist; what the old master of a
  Sentinel failover answers);
- OOM: ``maxmemory`` below the data with ``noeviction``;
- MISCONF: ``stop-writes-on-bgsave-error`` after a BGSAVE into a directory that is gone;
- NOREPLICAS: ``min-replicas-to-write 1`` with no replica;
- BUSY: a script looping past ``busy-reply-threshold`` (ended by SCRIPT KILL);
- LOADING: a restart that loads a snapshot slowly (``key-load-delay``); it ends by itself;
- an ACL taking a write command away from the drain's own user (:func:`acl_revoking`), which a
  script hears as a generic ``ERR The user executing the script can't run this command``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable

import redis

from tests.support import faultload, redis_server
from tests.support.waiting import wait_until

FILLER_DB = 15  # the LOADING case's snapshot lives here, apart from the jobs
FILLER_KEYS = 4_000
KEY_LOAD_DELAY_US = 1_000  # per key while loading: about 4 s of LOADING
BUSY_THRESHOLD_MS = 50
STATE_TIMEOUT_S = 60.0

Heal = Callable[[], None]


@dataclasses.dataclass(frozen=True)
class Refusal:
    code: str
    """What the drain's log must show while the server refuses (the error code, or a word)."""
    inject: Callable[[redis_server.RedisServer], Heal]


def _readonly(server: redis_server.RedisServer) -> Heal:
    client = server.client()
    client.replicaof("127.0.0.1", faultload.free_port())
    return lambda: client.replicaof("no", "one")


def _oom(server: redis_server.RedisServer) -> Heal:
    client = server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    return lambda: client.config_set("maxmemory", 0)


def _bgsave_status(client: redis.Redis[bytes], wanted: str) -> Callable[[], bool]:
    def done() -> bool:
        info = client.info("persistence")
        return not info["rdb_bgsave_in_progress"] and info["rdb_last_bgsave_status"] == wanted

    return done


def _misconf(server: redis_server.RedisServer) -> Heal:
    client = server.client()
    gone = server.directory / "gone"
    gone.mkdir()
    client.config_set("save", "3600 1")
    client.config_set("dir", str(gone))
    gone.rmdir()
    client.bgsave()
    wait_until("the BGSAVE to fail", _bgsave_status(client, "err"), STATE_TIMEOUT_S)

    def heal() -> None:
        client.config_set("dir", str(server.directory))
        client.bgsave()
        wait_until("a BGSAVE to succeed", _bgsave_status(client, "ok"), STATE_TIMEOUT_S)
        client.config_set("save", "")

    return heal


def _noreplicas(server: redis_server.RedisServer) -> Heal:
    client = server.client()
    client.config_set("min-replicas-to-write", 1)
    return lambda: client.config_set("min-replicas-to-write", 0)


def _busy(server: redis_server.RedisServer) -> Heal:
    client = server.client()
    client.config_set("busy-reply-threshold", BUSY_THRESHOLD_MS)
    looping = server.client()

    def loop() -> None:
        with contextlib.suppress(redis.ResponseError):  # "Script killed by user with SCRIPT KILL"
            looping.eval("while true do end", 0)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def busy() -> bool:
        try:
            client.ping()
        except redis.ResponseError as exc:
            return str(exc).startswith("BUSY")
        return False

    wait_until("the server to answer BUSY", busy, STATE_TIMEOUT_S)

    def heal() -> None:
        client.script_kill()
        thread.join(timeout=STATE_TIMEOUT_S)

    return heal


def _loading(server: redis_server.RedisServer) -> Heal:
    filler = server.client(FILLER_DB)
    with filler.pipeline(transaction=False) as pipe:
        for index in range(FILLER_KEYS):
            pipe.set(f"filler:{index}", index)
        pipe.execute()
    filler.save()
    server.stop()
    delay = ("--key-load-delay", str(KEY_LOAD_DELAY_US), "--loading-process-events-interval-bytes", "1024")
    server.start(*delay, wait=False)

    def loading() -> bool:  # PING and INFO are served while loading; writes get LOADING
        try:
            return bool(server.client().info("persistence")["loading"])
        except redis.ConnectionError:
            return False

    wait_until("the restarted server to be LOADING", loading, STATE_TIMEOUT_S)

    def heal() -> None:  # the load ends by itself; then drop the filler
        wait_until("the load to finish", lambda: not loading(), STATE_TIMEOUT_S)
        server.client().config_set("key-load-delay", 0)
        server.client(FILLER_DB).flushdb()

    return heal


REFUSALS = (
    Refusal("READONLY", _readonly),
    Refusal("OOM", _oom),
    Refusal("MISCONF", _misconf),
    Refusal("NOREPLICAS", _noreplicas),
    Refusal("BUSY", _busy),
    Refusal("LOADING", _loading),
)


def acl_revoking(user: str, *rules: str) -> Refusal:
    """``ACL SETUSER user rules...`` (e.g. ``-rpush``, ``-@write``) on the drain's own ``user``,
    healed by giving every command back. The drain's log names a script's ACL refusal with
    "script" in every Redis version's wording."""

    def inject(server: redis_server.RedisServer) -> Heal:
        client = server.client()
        client.execute_command("ACL", "SETUSER", user, *rules)
        return lambda: client.execute_command("ACL", "SETUSER", user, "+@all")

    return Refusal("script", inject)


def acl_keys(user: str, code: str, *patterns: str) -> Refusal:
    """The drain's own ``user`` may write only keys matching ``patterns`` (``ACL SETUSER user
    resetkeys ~p...``), healed by giving every key back. ``code``: what the log must show."""

    def inject(server: redis_server.RedisServer) -> Heal:
        client = server.client()
        client.execute_command("ACL", "SETUSER", user, "resetkeys", *(f"~{p}" for p in patterns))
        return lambda: client.execute_command("ACL", "SETUSER", user, "~*")

    return Refusal(code, inject)


def wrong_type(key: str, code: str = "") -> Refusal:
    """A key the drain writes (a shared one such as ``rq:queues``, or a queue's) holding a string,
    healed by deleting it. ``code``: what the log must show (default: the key's name)."""

    def inject(server: redis_server.RedisServer) -> Heal:
        client = server.client()
        client.delete(key)
        client.set(key, "not what the drain writes")
        return lambda: client.delete(key)

    return Refusal(code or key, inject)
