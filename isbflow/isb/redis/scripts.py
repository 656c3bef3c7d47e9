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

# Shared Lua: the server's clock in ms, entry ids compared as (ms, seq), and the incarnation made
# when it is missing (ARGV[1] of every writing script is a fresh random id for that case).
_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function id_ms(id) return tonumber(string.match(id, '^(%d+)')) end
local function id_less(a, b)
  local ams, aseq = string.match(a, '^(%d+)-(%d+)$')
  local bms, bseq = string.match(b, '^(%d+)-(%d+)$')
  ams, aseq, bms, bseq = tonumber(ams), tonumber(aseq), tonumber(bms), tonumber(bseq)
  return ams < bms or (ams == bms and aseq < bseq)
end
"""

#: KEYS stream, ids, inc. ARGV: new incarnation id, capacity (0: none), then (frame id, rows, payload)
#: per frame. Returns one reply per frame in order: the entry id, ``dup`` (the id is recorded), or a
#: last ``full`` (refused at capacity; the frames after it are not tried).
WRITE = _COMMON + """
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('HSET', KEYS[3], 'id', ARGV[1], 'created', now_ms(), 'released', 0, 'released_to', '0-0')
end
local cap = tonumber(ARGV[2])
local len = redis.call('XLEN', KEYS[1])
local out = {}
for i = 3, #ARGV, 3 do
  local fid = ARGV[i]
  if redis.call('ZSCORE', KEYS[2], fid) then
    out[#out + 1] = 'dup'
  elseif cap > 0 and len >= cap then
    out[#out + 1] = 'full'
    return out
  else
    local id = redis.call('XADD', KEYS[1], '*', 'id', fid, 'rows', ARGV[i + 1], 'f', ARGV[i + 2])
    redis.call('ZADD', KEYS[2], id_ms(id), fid)
    len = len + 1
    out[#out + 1] = id
  end
end
return out
"""

#: KEYS stream, ids, inc. ARGV: upto (entry id, released inclusive), the expected incarnation id
#: ('' = any), the dedup window in ms. Returns the entries removed, or -1 when the incarnation is not
#: the expected one (nothing removed). Frame ids are dropped from the index once their entries are
#: released AND older than the window, so a retry within the window still finds them.
RELEASE = _COMMON + """
local inc = redis.call('HGET', KEYS[3], 'id')
if ARGV[2] ~= '' and inc ~= ARGV[2] then return -1 end
local ms, seq = string.match(ARGV[1], '^(%d+)-(%d+)$')
local n = redis.call('XTRIM', KEYS[1], 'MINID', ms .. '-' .. string.format('%d', tonumber(seq) + 1))
if inc then
  redis.call('HINCRBY', KEYS[3], 'released', n)
  local before = redis.call('HGET', KEYS[3], 'released_to') or '0-0'
  if id_less(before, ARGV[1]) then redis.call('HSET', KEYS[3], 'released_to', ARGV[1]) end
end
local cut = math.min(tonumber(ms), now_ms() - tonumber(ARGV[3]))
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. string.format('%d', cut))
return n
"""

#: KEYS stream, ids, inc. ARGV: start, end (XRANGE bounds), count. Returns {incarnation id or nil,
#: entries}: read in one step, so the entries are the incarnation's.
READ = """
return {redis.call('HGET', KEYS[3], 'id'), redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[2], 'COUNT', ARGV[3])}
"""

#: KEYS stream, ids, inc. Returns {incarnation hash as a flat list, XINFO STREAM as a flat list or nil,
#: the dedup index's size}: everything loss detection and sizing need, from one instant.
STATE = """
local info = false
if redis.call('EXISTS', KEYS[1]) == 1 then info = redis.call('XINFO', 'STREAM', KEYS[1]) end
return {redis.call('HGETALL', KEYS[3]), info, redis.call('ZCARD', KEYS[2])}
"""

#: KEYS stream, ids, inc. ARGV: new incarnation id. Makes the incarnation when missing; returns its id.
CREATE = _COMMON + """
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('HSET', KEYS[3], 'id', ARGV[1], 'created', now_ms(), 'released', 0, 'released_to', '0-0')
end
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
