"""The one Redis call per batch: check every job id, and write the fresh jobs, atomically.

One server-side script per batch, so a batch costs one round trip to Redis however far away it
is (``Queue.enqueue_many`` also costs one: its MULTI/EXEC). For each job, in order:

1. its hash carries this row's mark (``rq_message.MARK_FIELD``): the duplicate a crash between
   Redis's reply and the database commit leaves — nothing is written, reply ``SKIPPED``;
2. its hash exists without that mark (a failed job kept for its failure_ttl, a job enqueued by
   other code): nothing is written, reply ``HELD``;
3. its queue key exists and is not a list: nothing is written, reply a reason (the queue's
   fault: its rows wait);
4. otherwise ``HSET`` of its fields, ``EXPIRE`` when it has a ttl, ``RPUSH`` (``LPUSH`` at the
   front) of its id, and ``SADD rq:queues`` once per queue — the writes of ``enqueue_many``.
   Reply ``WRITTEN``. Each write runs under ``pcall``: when Redis refuses one, what this job
   wrote is removed (so its retry is not taken for its own earlier forward) and the script
   stops there, its last reply being the pair (the key whose write was refused, the error).
   The key is the evidence the caller decides by (``rq.adapter``): only the queue's own key
   holding another type is that queue's; any other refusal (of the job's key, of the shared
   ``rq:queues``, an ACL, the server's) is the backend's.

A script is atomic (nothing runs between its commands), so no other client sees a job half
written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from drain_adapters.rq import message as rq_message

WRITTEN, SKIPPED, HELD = 0, 1, 2

# KEYS: job key and queue key of each job, then rq:queues. ARGV[1]: the mark field; then per job:
# mark, job id, at_front ("1"/"0"), ttl ("0" = none), n, then n field/value pairs.
SCRIPT = """
local mark_field = ARGV[1]
local queues_key = KEYS[#KEYS]
local kinds, registered, out = {}, {}, {}
local a = 2
for j = 1, (#KEYS - 1) / 2 do
  local job_key, queue_key = KEYS[2 * j - 1], KEYS[2 * j]
  local mark, id, front, ttl = ARGV[a], ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3])
  local first, last = a + 5, a + 4 + 2 * tonumber(ARGV[a + 4])
  a = last + 1
  if redis.pcall('HGET', job_key, mark_field) == mark then
    out[j] = 1
  elseif redis.call('EXISTS', job_key) == 1 then
    out[j] = 2
  else
    local kind = kinds[queue_key]
    if kind == nil then
      kind = redis.call('TYPE', queue_key)['ok']
      kinds[queue_key] = kind
    end
    if kind ~= 'none' and kind ~= 'list' then
      out[j] = 'the Redis key ' .. queue_key .. ' is a ' .. kind .. ', not an RQ queue list'
    else
      local failed, key = nil, nil
      if not registered[queue_key] then
        local r = redis.pcall('SADD', queues_key, queue_key)
        if type(r) == 'table' and r.err then
          failed, key = r.err, queues_key
        else
          registered[queue_key] = true
        end
      end
      if not failed then
        local r = redis.pcall('HSET', job_key, unpack(ARGV, first, last))
        if type(r) == 'table' and r.err then failed, key = r.err, job_key end
      end
      if not failed and ttl > 0 then
        local r = redis.pcall('EXPIRE', job_key, ttl)
        if type(r) == 'table' and r.err then failed, key = r.err, job_key end
      end
      if not failed then
        local r = redis.pcall(front == '1' and 'LPUSH' or 'RPUSH', queue_key, id)
        if type(r) == 'table' and r.err then failed, key = r.err, queue_key else kinds[queue_key] = 'list' end
      end
      if failed then
        redis.pcall('DEL', job_key)
        redis.pcall('LREM', queue_key, 0, id)
        out[j] = {key, failed}
        return out
      else
        out[j] = 0
      end
    end
  end
end
return out
"""


SHA = hashlib.sha1(SCRIPT.encode(), usedforsecurity=False).hexdigest().encode()
"""What Redis calls SCRIPT (EVALSHA's first argument): the SHA1 of its text."""
_FRONT, _BACK = b"$1\r\n1\r\n", b"$1\r\n0\r\n"
_NO_TTL = b"$1\r\n0\r\n"
_BULK = b"$%d\r\n%b\r\n"
_LAYOUTS: dict[tuple[bytes, ...], bytes] = {}
"""A job's ARGV after its at_front flag, as a format, by its hash's field names: RQ's hash has a
few sets of names, so a batch packs each job with one format call."""
MAX_LAYOUTS = 256


def _bulk(value: bytes) -> bytes:
    """One argument as Redis reads it: a RESP bulk string."""
    return _BULK % (len(value), value)


def _layout(names: tuple[bytes, ...]) -> bytes:
    """The format of a job's ttl, its field count, then each field's name and value: the ttl's
    bulk string and each value's (length, bytes) fill it in."""
    layout = _LAYOUTS.get(names)
    if layout is None:
        named = (_bulk(name).replace(b"%", b"%%") + _BULK for name in names)
        layout = b"%b" + _bulk(b"%d" % len(names)) + b"".join(named)
        if len(_LAYOUTS) < MAX_LAYOUTS:
            _LAYOUTS[names] = layout
    return layout


def command(messages: Sequence[rq_message.RQMessage]) -> bytes:
    """``EVALSHA SHA <keys> KEYS... ARGV...`` of SCRIPT for these jobs as the bytes Redis reads:
    what redis-py sends for :func:`arguments`, byte for byte (tests/backends/rq/test_rq_script.py),
    packed here in one pass. redis-py packs each argument on its own (a job has about 40: its
    hash's field names and values), which was a sixth of the drain's CPU per job in a backlog;
    here a job's fields are one format call (:func:`_layout`)."""
    keys: list[bytes] = []
    argv = [_bulk(rq_message.MARK_FIELD)]
    queue_keys: dict[bytes, bytes] = {}  # a batch has few queues
    count = 1
    for message in messages:
        keys.append(_bulk(message.job_key))
        queue_key = queue_keys.get(message.queue_key)
        if queue_key is None:
            queue_key = queue_keys[message.queue_key] = _bulk(message.queue_key)
        keys.append(queue_key)
        fields = message.fields
        values = list(fields.values())
        filled: list[object] = [None] * (1 + 2 * len(values))
        filled[0] = _bulk(b"%d" % message.ttl) if message.ttl else _NO_TTL
        filled[1::2] = map(len, values)
        filled[2::2] = values
        argv.append(_bulk(message.mark))
        argv.append(_bulk(message.job_id))
        argv.append(_FRONT if message.at_front else _BACK)
        argv.append(_layout(tuple(fields)) % tuple(filled))
        count += 5 + 2 * len(values)
    keys.append(_bulk(rq_message.QUEUES_KEY))
    head = b"*%d\r\n$7\r\nEVALSHA\r\n" % (3 + len(keys) + count)
    return b"".join((head, _bulk(SHA), _bulk(b"%d" % len(keys)), *keys, *argv))


def arguments(messages: Sequence[rq_message.RQMessage]) -> tuple[list[bytes], list[bytes | int]]:
    """(KEYS, ARGV) of SCRIPT for these jobs, as redis-py's own call takes them: the layout
    :func:`command` packs (its tests compare the two byte for byte)."""
    keys: list[bytes] = []
    argv: list[bytes | int] = [rq_message.MARK_FIELD]
    for message in messages:
        keys.append(message.job_key)
        keys.append(message.queue_key)
        argv.extend(
            (
                message.mark,
                message.job_id,
                b"1" if message.at_front else b"0",
                message.ttl or 0,
                len(message.fields),
            )
        )
        for field, value in message.fields.items():
            argv.append(field)
            argv.append(value)
    keys.append(rq_message.QUEUES_KEY)
    return keys, argv
