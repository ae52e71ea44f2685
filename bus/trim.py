"""Trimming streams without losing what a reader still needs, and reader positions.

Decisions:

- **A trim never removes unread work**: :meth:`TrimCommands.trim_safely` never cuts past
  any group's oldest pending entry nor its first undelivered one;
  :meth:`TrimCommands.trim_log` never cuts past the stored position of a reader whose
  liveness key exists. The check and the XTRIM run in one Lua script, so nothing can move
  in between.
- A log's trim may be **fenced** by a lease token: when another token holds the lease,
  nothing is trimmed and :class:`~bus.errors.Fenced` names the holder.
"""

from __future__ import annotations

from collections.abc import Sequence

from bus.client import BusClient
from bus.entries import entry_key, is_entry_id, to_text
from bus.errors import Fenced

__all__ = ["TrimCommands"]

# Entry-id order in Lua, for the scripts below: parse("ms-seq") -> ms, seq (and the ms text);
# less(a, b) compares two ids.
_LUA_ID_ORDER = """
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  if ms == nil then ms = string.match(id, '^(%d+)$'); seq = '0' end
  return tonumber(ms), tonumber(seq), ms
end
local function less(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  if am ~= bm then return am < bm end
  return as < bs
end
"""


# The floor of a group stream: the lowest of every group's oldest pending entry and first
# undelivered entry (nil: no group).
_LUA_FLOOR = """
local function group_floor(key)
  local floor = nil
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', key)) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    local gfloor
    if tonumber(info['pending']) > 0 then
      gfloor = redis.call('XPENDING', key, info['name'])[2]
    else
      local _, seq, ms = parse(info['last-delivered-id'])
      gfloor = ms .. '-' .. string.format('%d', seq + 1)
    end
    if floor == nil or less(gfloor, floor) then floor = gfloor end
  end
  return floor
end
"""


# Atomic safe trim. KEYS[1] stream; ARGV[1] "maxlen" | "minid"; ARGV[2] value.
# The cut never passes any group's oldest pending entry nor its first undelivered entry.
_TRIM_LUA = _LUA_ID_ORDER + _LUA_FLOOR + """
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then return 0 end
local floor = group_floor(key)
if ARGV[1] == 'minid' then
  local cut = ARGV[2]
  if floor ~= nil and less(floor, cut) then cut = floor end
  return redis.call('XTRIM', key, 'MINID', cut)
end
local n = tonumber(ARGV[2])
if floor == nil then return redis.call('XTRIM', key, 'MAXLEN', n) end
-- Count entries at or after the floor, in bounded batches, stopping once more than n.
local seen, start = 0, floor
while seen <= n do
  local batch = redis.call('XRANGE', key, start, '+', 'COUNT', 256)
  seen = seen + #batch
  if #batch < 256 then break end
  start = '(' .. batch[#batch][1]
end
if seen <= n then return redis.call('XTRIM', key, 'MAXLEN', n) end
return redis.call('XTRIM', key, 'MINID', floor)
"""


# KEYS[1] stream: its group floor ('' when the stream or its groups do not exist).
_FLOOR_LUA = _LUA_ID_ORDER + _LUA_FLOOR + """
if redis.call('EXISTS', KEYS[1]) == 0 then return '' end
return group_floor(KEYS[1]) or ''
"""


# Trim of a log below a safe point. KEYS[1] stream; KEYS[2] fencing lease key (or the stream
# when unfenced); KEYS[3..] pairs (reader position key, reader liveness key). ARGV[1] minid;
# ARGV[2] fencing token ('' = unfenced). The cut never passes the position of a reader whose
# liveness key exists. Returns the number trimmed, or -1 when the fence refused it.
_TRIM_LOG_LUA = _LUA_ID_ORDER + """
if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[2] then return -1 end
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then return 0 end
local cut = ARGV[1]
for i = 3, #KEYS - 1, 2 do
  if redis.call('EXISTS', KEYS[i + 1]) == 1 then
    local pos = redis.call('GET', KEYS[i])
    if pos and parse(pos) ~= nil and less(pos, cut) then cut = pos end
  end
end
return redis.call('XTRIM', key, 'MINID', cut)
"""


def _check_minid(minid: str) -> None:
    if not is_entry_id(minid):
        raise ValueError(f"minid must be an entry id like '1700000000000-0', got {minid!r}")


class TrimCommands(BusClient):
    """Safe XTRIM of group streams and of logs; reader positions."""

    async def trim_safely(
        self, stream: str, *, maxlen: int | None = None, minid: str | None = None
    ) -> int:
        """Trim to ``maxlen`` entries or below ``minid``, but never remove an entry at or after
        any group's oldest pending entry, nor one not yet delivered to a group (after its
        last-delivered-id). Returns the number of entries removed.

        Wraps one Lua script (XINFO GROUPS, XPENDING, XTRIM MINID/MAXLEN), so the check and
        the trim are atomic. With ``maxlen`` it scans at most ``maxlen`` entries past the
        slowest group's floor.
        """
        if (maxlen is None) == (minid is None):
            raise ValueError("trim_safely needs exactly one of maxlen= or minid=")
        if maxlen is not None and maxlen < 0:
            raise ValueError(f"maxlen must be >= 0, got {maxlen}")
        if minid is not None:
            _check_minid(minid)
        mode, value = ("maxlen", str(maxlen)) if maxlen is not None else ("minid", str(minid))
        return int(await self.run_script(_TRIM_LUA, [stream], [mode, value], op="XTRIM"))

    async def trim_floor(self, stream: str) -> str | None:
        """The id below which :meth:`trim_safely` may cut now: the lowest of every group's
        oldest pending entry and first undelivered one (None: no group, or no stream). Never
        lower later (acks and deliveries only raise it), so everything below it is done with:
        a copy of it made now (the run's record) is what a trim below it removes."""
        floor = to_text(await self.run_script(_FLOOR_LUA, [stream], [], op="XINFO"))
        return floor or None

    async def trim_log(
        self,
        stream: str,
        minid: str,
        *,
        readers: Sequence[tuple[str, str]] = (),
        fence: tuple[str, str] | None = None,
    ) -> int:
        """Remove the entries before ``minid`` from a log (a stream without groups), but
        never one at or after the position held in a reader's key while that reader's
        liveness key exists (``readers``: ``(position key, liveness key)`` pairs, see
        :meth:`set_position`). With ``fence=(lease key, token)`` nothing is trimmed unless
        the lease holds that token (:class:`~bus.errors.Fenced`). Returns how many entries
        were removed.

        Wraps one Lua script (GET, EXISTS, XTRIM MINID), so the check and the trim are
        atomic: a reader that stored its position before reading never loses what follows it.
        """
        _check_minid(minid)
        keys = [stream, fence[0] if fence else stream]
        for position_key, alive_key in readers:
            keys += [position_key, alive_key]
        token = fence[1] if fence else ""
        removed = int(await self.run_script(_TRIM_LOG_LUA, keys, [minid, token], op="XTRIM"))
        if removed < 0 and fence is not None:
            holder = await self.command("GET", fence[0])
            raise Fenced(fence[0], fence[1], None if holder is None else to_text(holder))
        return removed

    async def set_position(self, key: str, entry_id: str) -> None:
        """Store a reader's position in a log (an entry id it needs kept, see
        :meth:`trim_log`). Wraps SET."""
        if not is_entry_id(entry_id):
            raise ValueError(f"not an entry id: {entry_id!r}")
        await self.command("SET", key, entry_id)

    async def reader_floor(self, readers: Sequence[tuple[str, str]]) -> str | None:
        """The lowest position among ``readers`` (``(position key, liveness key)``) whose
        liveness key exists; None when none holds one. Wraps GET and EXISTS (pipelined, in
        one MULTI/EXEC)."""
        commands = []
        for position_key, alive_key in readers:
            commands += [("GET", position_key), ("EXISTS", alive_key)]
        replies = await self.pipeline(commands, atomic=True)
        floor: str | None = None
        for position, alive in zip(replies[::2], replies[1::2], strict=True):
            if position is None or not int(alive):
                continue
            text = to_text(position)
            if is_entry_id(text) and (floor is None or entry_key(text) < entry_key(floor)):
                floor = text
        return floor
