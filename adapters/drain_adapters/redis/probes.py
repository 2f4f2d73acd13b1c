"""What ``drain check`` asks of Redis: that each key the drain writes holds the type it writes,
and that the drain's user may write it.

Each key is probed with a write that changes nothing (``SREM`` of a member no set holds,
``LREM`` of a value no list holds, ``HDEL`` of a field no hash has): Redis checks the user's ACL
(the command and the key) and the key's type for it exactly as for the drain's real writes. So
the probe needs no ``ACL`` permission of its own, and works on every Redis version.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import redis

from drain_adapters.redis import errors as redis_errors

NO_OP_WRITES = {
    "set": ("SREM", "{key}", "{absent}"),
    "list": ("LREM", "{key}", "0", "{absent}"),
    "hash": ("HDEL", "{key}", "{absent}"),
}


def absent_key(prefix: str) -> str:
    """A key of the drain's pattern no one holds (``prefix`` then a fresh uuid)."""
    return f"{prefix}{uuid.uuid4()}"


def key_problems(client: Any, keys: Sequence[tuple[str, str]]) -> list[str]:
    """One line per problem with the ``(key, type)`` pairs: a key holding another type, a
    write the server refuses. Raises redis's connection errors (the caller's outage)."""
    problems: list[str] = []
    absent = str(uuid.uuid4())
    for key, kind in keys:
        try:
            found = client.type(key)
            found = found.decode() if isinstance(found, bytes) else str(found)
            if found not in ("none", kind):
                problems.append(f"the Redis key {key!r} is a {found}, not a {kind}")
                continue
            command = [part.format(key=key, absent=absent) for part in NO_OP_WRITES[kind]]
            client.execute_command(*command)
        except redis.ResponseError as exc:
            problems.append(f"may not write the Redis key {key!r}: {redis_errors.reason(exc)}")
    return problems
