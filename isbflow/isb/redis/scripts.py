"""The Lua scripts of the Redis store: each runs atomically on the server.

Why scripts: Redis Streams have no duplicates window (JetStream's ``Nats-Msg-Id``), so an
idempotent append must check the frame id and append in one step; a check from the client
followed by an ``XADD`` would let two writers of the same frame both append. A script is never
interleaved with another command, so :data:`WRITE` checks, appends and records the id as one
step, and concurrent or repeated writers of the same frame ids store each once.

Each script takes the partition's three keys (:class:`isbflow.isb.redis.keys.BufferKeys.all`)
and is called with ``EVALSHA``; a server that does not know it yet (just started, or ``SCRIPT
FLUSH``) answers ``NOSCRIPT`` and the call is sent again with ``EVAL`` (:func:`run`). Every
command a script calls is checked against the caller's ACL (:mod:`isbflow.isb.redis.acl`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

# Shared Lua: the server's clock in ms, integers as Redis arguments, and the incarnation made when
# it is missing (ARGV[1] of every writing script is a fresh random id for that case).
_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(n) return string.format('%d', n) end
local function ensure_incarnation(new_id)
  if redis.call('EXISTS', KEYS[3]) == 0 then
    redis.call('HSET', KEYS[3], 'id', new_id, 'created', int(now_ms()), 'released', 0, 'released_to', 0,
               'wrote_at', 0)
  end
end
"""

#: KEYS stream, ids, inc. ARGV: new incarnation id ('' = the partition must have one: a partition
#: never provisioned or lost is not made again behind its readers' backs, the reply is ``missing``),
#: capacity (0: none), then (frame id, rows, payload)
#: per frame. Returns one reply per frame in order: the entry id (``0-<offset>``), ``dup`` (the id is
#: recorded), or a last ``full`` (refused at capacity; the frames after it are not tried). Entries
#: are appended with ``0-*`` (consecutive offsets from 1) and stamped with the write time ``t``: the
#: server's clock, never below the last write's (``wrote_at``), so write times follow offsets even
#: when the clock steps back; the dedup index scores each id with it (see :data:`RELEASE`).
WRITE = _COMMON + """
if ARGV[1] ~= '' then
  ensure_incarnation(ARGV[1])
elseif redis.call('EXISTS', KEYS[3]) == 0 then
  return {'missing'}
end
local cap = tonumber(ARGV[2])
local len = redis.call('XLEN', KEYS[1])
local t = int(math.max(now_ms(), tonumber(redis.call('HGET', KEYS[3], 'wrote_at')) or 0))
local out, wrote = {}, false
for i = 3, #ARGV, 3 do
  local fid = ARGV[i]
  if redis.call('ZSCORE', KEYS[2], fid) then
    out[#out + 1] = 'dup'
  elseif cap > 0 and len >= cap then
    out[#out + 1] = 'full'
    break
  else
    out[#out + 1] = redis.call('XADD', KEYS[1], '0-*', 'id', fid, 'rows', ARGV[i + 1], 'f', ARGV[i + 2], 't', t)
    redis.call('ZADD', KEYS[2], t, fid)
    len = len + 1
    wrote = true
  end
end
if wrote then redis.call('HSET', KEYS[3], 'wrote_at', t) end
return out
"""

#: KEYS stream, ids, inc. ARGV: upto (an integer offset, released inclusive), the expected incarnation
#: id ('' = any), the dedup window in ms. Returns the entries removed, or -1 when the incarnation is not
#: the expected one (nothing removed). Then frame ids written before ``cut`` leave the index, ``cut``
#: being the earlier of now minus the window and the write time of the first entry the stream still
#: holds: an id stays while its entry is unreleased (write times follow offsets, :data:`WRITE`) and,
#: released, for the window after its write, so a retry within the window still finds it. An entry
#: without a write time holds every id.
RELEASE = _COMMON + """
local inc = redis.call('HGET', KEYS[3], 'id')
if ARGV[2] ~= '' and inc ~= ARGV[2] then return -1 end
local upto = tonumber(ARGV[1])
local n = redis.call('XTRIM', KEYS[1], 'MINID', '0-' .. int(upto + 1))
if inc then
  redis.call('HINCRBY', KEYS[3], 'released', n)
  if (tonumber(redis.call('HGET', KEYS[3], 'released_to')) or 0) < upto then
    redis.call('HSET', KEYS[3], 'released_to', int(upto))
  end
end
local cut = now_ms() - tonumber(ARGV[3])
local head = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
if head then
  local t = 0
  for i = 1, #head[2], 2 do
    if head[2][i] == 't' then t = tonumber(head[2][i + 1]) or 0 end
  end
  cut = math.min(cut, t)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. int(cut))
return n
"""

#: KEYS stream, ids, inc. ARGV: start, end (XRANGE bounds), count. Returns {incarnation id or nil,
#: entries}: read in one step, so the entries are the incarnation's.
READ = """
return {redis.call('HGET', KEYS[3], 'id'), redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[2], 'COUNT', ARGV[3])}
"""

#: KEYS stream, ids, inc. Returns {incarnation hash as a flat list, the stream's ``length``,
#: ``entries-added``, ``last-generated-id`` and ``first-entry`` (its id only, absent when empty) as a
#: flat list, or nil without a stream key, the dedup index's size}: everything loss detection and
#: sizing need, from one instant, without sending any frame's bytes.
STATE = """
local s = false
if redis.call('EXISTS', KEYS[1]) == 1 then
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  s = {}
  for i = 1, #info, 2 do
    local k, v = info[i], info[i + 1]
    if k == 'length' or k == 'entries-added' or k == 'last-generated-id' then
      s[#s + 1] = k
      s[#s + 1] = v
    elseif k == 'first-entry' and v then
      s[#s + 1] = k
      s[#s + 1] = v[1]
    end
  end
end
return {redis.call('HGETALL', KEYS[3]), s, redis.call('ZCARD', KEYS[2])}
"""

#: KEYS stream, ids, inc. ARGV: new incarnation id. Makes the incarnation when missing; returns its id.
CREATE = _COMMON + """
ensure_incarnation(ARGV[1])
return redis.call('HGET', KEYS[3], 'id')
"""


def sha1(script: str) -> str:
    """The id ``EVALSHA`` knows ``script`` by."""
    return hashlib.sha1(script.encode()).hexdigest()


_SHAS = {s: sha1(s) for s in (WRITE, RELEASE, READ, STATE, CREATE)}


async def run(client: Any, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """``EVALSHA`` of ``script`` on ``client`` (a ``redis.asyncio`` client), ``EVAL`` when the
    server does not know it yet. Safe to send twice: every script here is idempotent or, for
    :data:`WRITE`, deduplicates."""
    try:
        return await client.evalsha(_SHAS[script], len(keys), *keys, *args)
    except NoScriptError:
        return await client.eval(script, len(keys), *keys, *args)
