"""Liveness judged by Redis's clock, and the trainer's fencing lease.

Pulses are not facts, so they stay out of the durable events log: every component refreshes
a key with a TTL (``SET key HEARTBEAT PX timeout``) once per heartbeat interval, from a task
that heavy work never blocks (that work runs on a worker thread). A key that exists means
"this process spoke within the timeout", by the Redis server's clock alone: no two hosts'
clocks are ever compared, and a long step is not mistaken for death.

The trainer's lease is the same idea with a fencing token: one trainer per run holds
``rlbus:{RUN}:trainer-lease`` (value = its token) and every trainer write is a Lua script
that first checks the token, so a second trainer, or a paused zombie of the first whose
lease lapsed, cannot write a single entry.

    ``pulse(bus, key, heartbeat, ttl_s)``                 SET PX + SADD
    ``pulse_forever(bus, key, heartbeat, interval_s, ttl_s, before=, wake=)``
        every component's liveness task: one pulse per interval (or at once on ``wake``)
    ``peers(bus, pattern) -> list[Heartbeat]``            SMEMBERS + MGET
    ``Lease(bus, key, token, ttl_s)``
        ``acquire() -> str | None``        SET NX PX; None, or the holder's token when taken
        ``steal(holder) -> bool``          compare-and-set (EVAL) when the holder is known dead
        ``renew() -> bool``                compare-and-PEXPIRE (EVAL)
        ``release()``                      compare-and-DEL (EVAL)
        ``remaining_ms() -> int``          PTTL
        ``write(items, ack=None, require=None) -> list[str]``   token check (+ an entry
            that must still exist) + XADDs + XACK, one EVAL
        ``run_fenced(body, keys, args, require=None)``   any Lua ``body`` behind the same
            checks, one EVAL (the trainer's consumer-group calls: :class:`bus.groups.Consumer`
            with ``fence=``)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence

from redis.exceptions import ResponseError

from bus.client import Arg, Reply
from bus.errors import EntryGone, Fenced
from bus.retry import RetryHook
from bus.streams import Bus
from runschema.messages import FIELD, DecodeError, Heartbeat, Message, decode, encode

__all__ = ["FENCE_LUA", "Lease", "members_key", "peers", "pulse", "pulse_forever"]


def members_key(key_or_pattern: str) -> str:
    """The set that lists the liveness keys of one role (``...:alive:ROLE:members``), for
    the liveness key ``...:alive:ROLE:RANK`` or the pattern ``...:alive:ROLE:*``: readers
    find their peers there, so no component user needs SCAN (which would show the key names
    of every run on the server)."""
    return f"{key_or_pattern.rsplit(':', 1)[0]}:members"


async def pulse(bus: Bus, key: str, heartbeat: Heartbeat, ttl_s: float) -> None:
    """Say "alive" for ``ttl_s`` seconds, with ``heartbeat`` as the value, and list the key
    in its role's members set (:func:`members_key`). Wraps SET PX and SADD (one round
    trip)."""
    ttl_ms = max(1, int(ttl_s * 1000))
    data = encode(heartbeat)
    await bus.pipeline([("SET", key, data, "PX", ttl_ms), ("SADD", members_key(key), key)],
                       atomic=False, op="SET")


async def pulse_forever(
    bus: Bus,
    key: str,
    heartbeat: Callable[[], Heartbeat],
    interval_s: float,
    ttl_s: float,
    *,
    before: Callable[[], Awaitable[None]] | None = None,
    wake: asyncio.Event | None = None,
) -> None:
    """The liveness task of every component, until cancelled: :func:`pulse` with
    ``heartbeat()`` every ``interval_s``, or at once when ``wake`` is set. ``before`` runs
    first at each beat (the trainer renews its lease there). Run it as its own task: heavy
    work elsewhere (on worker threads) never delays it, so a long step is not silence."""
    while True:
        if before is not None:
            await before()
        if wake is not None:
            wake.clear()
        await pulse(bus, key, heartbeat(), ttl_s)
        if wake is None:
            await asyncio.sleep(interval_s)
            continue
        # asyncio.timeout, not wait_for: on 3.11 a wait_for whose event fires as the task is
        # cancelled swallows the cancellation, and this loop would never end.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await wake.wait()


async def peers(bus: Bus, pattern: str) -> list[Heartbeat]:
    """The latest heartbeats of every live component of one role (``pattern``:
    ``...:alive:ROLE:*``, :meth:`bus.RunKeys.alive_pattern`); undecodable values are
    skipped. Wraps SMEMBERS of the role's members set, then MGET (a pattern over every role,
    ``...:alive:*:*``, is read with SCAN MATCH: for tools run as an admin)."""
    if ":*:" in pattern:
        keys = await bus.scan(pattern)
    else:
        keys = sorted(k.decode() for k in await bus.command("SMEMBERS", members_key(pattern)))
    if not keys:
        return []
    values = await bus.command("MGET", *keys)
    found = []
    for raw in values:
        if raw is None:  # expired between SCAN and MGET
            continue
        try:
            msg = decode(raw)
        except DecodeError:
            continue
        if isinstance(msg, Heartbeat):
            found.append(msg)
    return found


# KEYS[1] lease; ARGV[1] expected token; ARGV[2] new token; ARGV[3] ttl ms.
_STEAL_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""

# KEYS[1] lease; ARGV[1] token; ARGV[2] ttl ms (0: delete).
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then redis.call('DEL', KEYS[1]) else redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""

# Fenced write. KEYS[1] lease; KEYS[2..n+1] one stream per item; then, optionally, the stream
# to ack in and the stream that must still hold entry ARGV[4]. ARGV[1] token; ARGV[2] field;
# ARGV[3] n; ARGV[4] required entry id ('' for none); ARGV[5] ack group ('' for none);
# ARGV[6] floor: an entry id every new entry must come after ('' for none); ARGV[7..n+6]
# encoded messages; ARGV[n+7..] entry ids to ack. Returns the new entry ids; false when the
# token does not hold the lease, -1 when the required entry is gone (nothing is written
# either way).
#
# The floor: the merged log orders entries of different streams by millisecond, then role
# (bus.keys.log_order), and the trainer's role comes first; so while Redis's clock is still
# in the floor's millisecond (the newest entry the trainer read from another role's stream),
# a new entry takes an explicit id in the next millisecond (or after its stream's newest), and
# the merged log puts it after what it answers. A floor over a second ahead of the clock is
# ignored, so no writer of another stream can push the trainer's ids into the future.
_WRITE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
local n = tonumber(ARGV[3])
local k = n + 2
if ARGV[5] ~= '' then k = k + 1 end
if ARGV[4] ~= '' then
  if #redis.call('XRANGE', KEYS[k], ARGV[4], ARGV[4]) == 0 then return -1 end
end
local fms = string.match(ARGV[6], '^(%d+)-%d+$')
local function next_id(key)
  if not fms then return '*' end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  -- Past the floor's millisecond: Redis's id is after it. A floor more than a second ahead
  -- of the clock is nobody's answer (an id forced into the future): not followed.
  if now > tonumber(fms) or tonumber(fms) > now + 1000 then return '*' end
  local ms, seq = tonumber(fms) + 1, 0
  local top = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1]
  if top then
    local lms, lseq = string.match(top[1], '^(%d+)-(%d+)$')
    lms, lseq = tonumber(lms), tonumber(lseq)
    if lms > ms or (lms == ms and lseq >= seq) then ms, seq = lms, lseq + 1 end
  end
  return string.format('%d-%d', ms, seq)
end
local ids = {}
for i = 1, n do
  ids[i] = redis.call('XADD', KEYS[i + 1], next_id(KEYS[i + 1]), ARGV[2], ARGV[i + 6])
end
if ARGV[5] ~= '' and #ARGV > n + 6 then
  redis.call('XACK', KEYS[n + 2], ARGV[5], unpack(ARGV, n + 7))
end
return ids
"""


FENCE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('FENCED') end
if ARGV[2] ~= '' and #redis.call('XRANGE', KEYS[2], ARGV[2], ARGV[2]) == 0 then
  return redis.error_reply('ENTRYGONE')
end
"""
"""The checks every :meth:`Lease.run_fenced` body runs behind, in the same script: KEYS[1]
the lease, ARGV[1] the token; KEYS[2] a stream that must still hold entry ARGV[2] ('' for
none). The body's own keys start at KEYS[3], its args at ARGV[3]."""


class Lease:
    """A fencing lease on ``key`` for the holder of ``token`` (see the module docstring)."""

    def __init__(self, bus: Bus, key: str, token: str, ttl_s: float) -> None:
        self.bus = bus
        self.key = key
        self.token = token
        self.ttl_ms = max(1, int(ttl_s * 1000))

    async def acquire(self) -> str | None:
        """Take the lease if free: None on success, else the current holder's token.
        Wraps SET NX PX and GET (pipelined: the GET tells who holds it when SET NX fails)."""
        ok, holder = await self.bus.pipeline(
            [("SET", self.key, self.token, "NX", "PX", self.ttl_ms), ("GET", self.key)]
        )
        if ok:
            return None
        if holder is None:  # expired between SET NX and GET: try once more
            return await self.acquire()
        text: str = holder.decode(errors="replace")
        return text

    async def steal(self, holder: str) -> bool:
        """Replace ``holder``'s token by ours (only if it still holds it). Wraps EVAL."""
        args: list[Arg] = [holder, self.token, self.ttl_ms]
        return bool(await self.bus.run_script(_STEAL_LUA, [self.key], args))

    async def renew(self) -> bool:
        """Extend our lease; False if we no longer hold it. Wraps EVAL (GET + PEXPIRE)."""
        args: list[Arg] = [self.token, self.ttl_ms]
        return bool(await self.bus.run_script(_RENEW_LUA, [self.key], args))

    async def release(self) -> None:
        """Give the lease up if we hold it. Wraps EVAL (GET + DEL)."""
        args: list[Arg] = [self.token, 0]
        await self.bus.run_script(_RENEW_LUA, [self.key], args)

    async def holder(self) -> str | None:
        """The token holding the lease now (None: free). Wraps GET."""
        raw = await self.bus.command("GET", self.key)
        return None if raw is None else raw.decode(errors="replace")

    async def remaining_ms(self) -> int:
        """Milliseconds the lease has left (-2: free). Wraps PTTL."""
        return int(await self.bus.command("PTTL", self.key))

    async def write(
        self,
        items: Sequence[tuple[str, Message]],
        ack: tuple[str, str, Sequence[str]] | None = None,
        require: tuple[str, str] | None = None,
        floor: str | None = None,
    ) -> list[str]:
        """Append ``(stream, msg)`` items and XACK ``ack = (stream, group, ids)``, all in one
        script that first checks our token (and, with ``require = (stream, id)``, that this
        entry is still there): everything lands, in order, or nothing does. ``floor``: an
        entry id (of another stream, read before this write) every new entry's id must
        exceed (see ``_WRITE_LUA``).

        Raises :class:`~bus.errors.Fenced` when another token holds the lease, and
        :class:`~bus.errors.EntryGone` when the required entry is missing (the log lost its
        tail). Wraps EVAL (GET, XRANGE, XADD..., XACK); every key must share the run's slot.
        """
        keys = [self.key, *(stream for stream, _ in items)]
        acked = ack is not None and bool(ack[2])
        args: list[Arg] = [self.token, FIELD, len(items), require[1] if require else "",
                           ack[1] if ack is not None and acked else "", floor or ""]
        args += [encode(m) for _, m in items]
        if ack is not None and acked:
            keys.append(ack[0])
            args += list(ack[2])
        if require is not None:
            keys.append(require[0])
        reply = await self.bus.run_script(_WRITE_LUA, keys, args)
        if reply is None:
            holder = await self.holder()
            raise Fenced(self.key, self.token, holder)
        if reply == -1 and require is not None:
            raise EntryGone(require[0], require[1])
        return [i.decode() if isinstance(i, bytes) else str(i) for i in reply]

    async def run_fenced(
        self, body: str, keys: Sequence[str], args: Sequence[Arg], *,
        require: tuple[str, str] | None = None, op: str = "EVAL",
        on_retry: RetryHook | None = None,
    ) -> Reply:
        """Run the Lua ``body`` only while our token holds the lease (and, with ``require =
        (stream, id)``, while that entry is still there), atomically: the checks are
        :data:`FENCE_LUA`, so the body reads its own ``keys`` from KEYS[3] and its ``args``
        from ARGV[3] on. Returns the body's reply.

        Raises :class:`~bus.errors.Fenced` / :class:`~bus.errors.EntryGone` as :meth:`write`
        does (the body did not run). Wraps EVAL (GET, XRANGE, then the body); every key
        must share the run's slot."""
        stream, entry = require if require is not None else (self.key, "")
        try:
            return await self.bus.run_script(FENCE_LUA + body, [self.key, stream, *keys],
                                             [self.token, entry, *args], op=op,
                                             on_retry=on_retry)
        except ResponseError as exc:
            if str(exc) == "FENCED":
                raise Fenced(self.key, self.token, await self.holder()) from exc
            if str(exc) == "ENTRYGONE" and require is not None:
                raise EntryGone(require[0], require[1]) from exc
            raise
