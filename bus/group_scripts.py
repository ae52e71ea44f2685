"""The Lua bodies of a fenced consumer's group calls (:class:`bus.groups.Consumer` with
``fence=``), and the :class:`Fence` they run behind: each body runs inside
:data:`bus.liveness.FENCE_LUA`, after its token check, so a member whose lease was taken
cannot read, ack, dead-letter or claim one entry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from bus.client import RetryHook

__all__ = ["ADD_AND_ACK_LUA", "ADOPT_LUA", "CALL_LUA", "READ_LUA", "Fence"]


class Fence(Protocol):
    """What fences a :class:`Consumer`'s group calls: :class:`bus.liveness.Lease` (or a
    wrapper of it, such as the trainer's writer). ``run_fenced`` runs the Lua ``body`` only
    while the fence holds; the body's keys start at KEYS[3], its args at ARGV[3]
    (:data:`bus.liveness.FENCE_LUA`); it raises :class:`~bus.errors.Fenced` otherwise."""

    async def run_fenced(
        self, body: str, keys: Sequence[str], args: Sequence[Any], *, op: str = "EVAL",
        on_retry: RetryHook | None = None,
    ) -> Any: ...


# Bodies run behind a fence (bus.liveness.FENCE_LUA): own keys from KEYS[3], args from
# ARGV[3]. redis.pcall + returning the error keeps Redis's own error ("NOGROUP ...") as the
# reply on every server version (6.2 wraps a raised one in "ERR Error running script").

# One command, ARGV[3..] (its keys are among KEYS[3..]).
CALL_LUA = "return redis.pcall(unpack(ARGV, 3))"

# XREADGROUP GROUP ARGV[3] ARGV[4] COUNT ARGV[5] STREAMS KEYS[3] ARGV[6]. Returns {reply,
# ''}, or {nil, id of the stream's last entry ('0-0': empty)} when nothing came: where the
# caller's blocking XREAD waits from.
READ_LUA = """
local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[3], ARGV[4], 'COUNT', ARGV[5],
                      'STREAMS', KEYS[3], ARGV[6])
if type(r) == 'table' and r.err then return r end
if r then return {r, ''} end
local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
if #last == 0 then return {false, '0-0'} end
return {false, last[1][1]}
"""

# XACK KEYS[3] ARGV[3] ARGV[n+6..], then XADD KEYS[4] * ARGV[4] ARGV[5+i] for i = 1..n
# (n = ARGV[5]), atomically as MULTI/EXEC would. Returns {new ids, how many were pending}.
ADD_AND_ACK_LUA = """
local n = tonumber(ARGV[5])
local acked = 0
if #ARGV > n + 5 then
  acked = redis.pcall('XACK', KEYS[3], ARGV[3], unpack(ARGV, n + 6))
  if type(acked) == 'table' and acked.err then return acked end
end
local ids = {}
for i = 1, n do ids[i] = redis.call('XADD', KEYS[4], '*', ARGV[4], ARGV[5 + i]) end
return {ids, acked}
"""

# Member ARGV[5] of group ARGV[3] on KEYS[3]: XCLAIM (JUSTID: its delivery counter is kept,
# our next read of our own pending entries counts one more) up to ARGV[6] of its pending
# entries for ARGV[4]; once it owns none, XGROUP DELCONSUMER it. Returns {ids it held,
# ids claimed} ({{}, {}}: removed). Redis 7 drops an entry deleted while pending from the PEL
# instead of claiming it (6.2 claims it: our read finds it trimmed).
ADOPT_LUA = """
local rows = redis.pcall('XPENDING', KEYS[3], ARGV[3], '-', '+', ARGV[6], ARGV[5])
if type(rows) == 'table' and rows.err then return rows end
if #rows == 0 then
  redis.call('XGROUP', 'DELCONSUMER', KEYS[3], ARGV[3], ARGV[5])
  return {{}, {}}
end
local held = {}
local claim = {'XCLAIM', KEYS[3], ARGV[3], ARGV[4], 0}
for i, row in ipairs(rows) do
  held[i] = row[1]
  claim[#claim + 1] = row[1]
end
claim[#claim + 1] = 'JUSTID'
return {held, redis.call(unpack(claim))}
"""
