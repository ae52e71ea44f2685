"""Redis Streams for rlbus: publishing, consumer groups, log reading, safe trimming.

One :class:`Bus` per process holds one ``redis.asyncio.Redis`` client (bytes in, bytes out).
Every stream entry has a single field :data:`bus.messages.FIELD` holding one encoded message.
Entry ids are returned as ``str`` (``"1700000000000-0"``).

Bus (all coroutines unless noted)
    ``Bus.from_url(url, *, retry=RetryPolicy(), op_timeout_s=30.0,
    connect_timeout_s=5.0, client_name=None) -> Bus`` (plain function; ``redis://``,
    ``rediss://``, ``redis://user:password@host:port/db``)
    ``publish(stream, msg, *, maxlen=None) -> str``                      XADD
    ``publish_many(stream, msgs, *, atomic=False, maxlen=None) -> list[str]``
        pipelined XADDs; ``atomic=True`` wraps them in MULTI/EXEC (all or nothing)
    ``publish_multi([(stream, msg), ...], *, atomic=True) -> list[str]``
        XADDs to several streams in one MULTI/EXEC (a run's keys share one hash slot)
    ``publish_raw(stream, fields) -> str``      XADD of arbitrary fields (tools, tests)
    ``publish_guarded(stream, msg, guard_key, first_step) -> str | None``
        XADD only while ``GET guard_key`` < ``first_step``, atomically (EVAL/EVALSHA): the
        entry id, or None when refused (a step barrier, see :meth:`Bus.set_barrier`)
    ``set_barrier(key, step) -> int``   raise an int key to ``step``, never lower it (EVAL:
        GET + SET); returns the value it holds now
    ``get_barrier(key) -> int``         GET, 0 when the key is missing
    ``read_all(stream, start="0", end="+", *, count=500, on_bad=None)``
        async iterator of :class:`Entry` ``(id, msg)``, XRANGE paging, for folding state
    ``tail(stream, last_id="$", *, block_ms=1000, count=100, on_bad=None, stop=None,
    idle_timeout_s=None)``  async iterator of :class:`Entry` (XREAD BLOCK). ``last_id="$"``
        follows new entries only; ``last_id="0"`` reads the log from its beginning, then
        follows. Ends when ``stop`` (an ``asyncio.Event``) is set or nothing arrived for
        ``idle_timeout_s``; otherwise runs until the caller breaks out.
    ``read_after(stream, last_id, *, count=100, block_ms=None, on_bad=None)
    -> (list[Entry], cursor)``   one XREAD, for poll loops that keep their own cursor
    ``latest(stream) -> Entry | None``                                    XREVRANGE COUNT 1
    ``read_ids(stream, ids) -> {id: msg}``        pipelined XRANGE id id (replay by entry id)
    ``read_page(stream, after="0", end="+", *, count=500) -> (first id, raw entries)``
        XRANGE - + COUNT 1 and XRANGE (after end in one MULTI/EXEC (bus.history)
    ``decode_entry(stream, id, fields, on_bad=None) -> Entry | None`` (plain function)
    ``trim_log(stream, minid, *, readers=(), fence=None) -> int``   XTRIM MINID (Lua), never
        past a live reader's stored position; fenced by a lease token when given
    ``set_position(key, entry_id)``                                       SET
    ``reader_floor(readers) -> str | None``   lowest live reader position  GET + EXISTS
    ``set_text(key, value)``, ``get_text(key) -> str | None``              SET, GET
    ``length(stream) -> int``                                             XLEN
    ``groups(stream) -> list[GroupInfo]``                                 XINFO GROUPS
    ``consumers(stream, group) -> list[str]``                             XINFO CONSUMERS
    ``scan(pattern) -> list[str]``                                        SCAN MATCH
    ``trim_safely(stream, *, maxlen=None, minid=None) -> int``            XTRIM (Lua)
    ``destroy_group(stream, group) -> bool``                              XGROUP DESTROY
    ``delete(*keys) -> int``                                              DEL
    ``exists(key) -> bool``                                               EXISTS
    ``server_time() -> float``   Redis's clock, s (entry ids are its ms)  TIME
    ``command(*args) -> Any``   one raw command under the retry policy (tools, tests)
    ``ping()``, ``server_version() -> (major, minor, patch)``, ``close()``
    ``on_retry``: optional hook ``(op, attempt, error)`` called before each retry wait
    ``consumer(stream, group, name, **kw) -> Consumer`` (plain function)

Consumer(bus, stream, group, name, *, max_deliveries=5, min_idle_ms=60_000,
dlq_stream=None, accept=None)
    ``ensure_group(start_id="0") -> bool``                 XGROUP CREATE ... MKSTREAM
    ``read(count=64, block_ms=1000) -> list[Delivery]``    XREADGROUP (own pending ``0``
        first, then ``>``)
    ``ack(*ids_or_deliveries) -> int``                     XACK
    ``reclaim(min_idle_ms=None, count=100) -> list[Delivery]``   XAUTOCLAIM + XPENDING
    ``reclaim_from(owners, count=100) -> list[Delivery]``   XPENDING per owner + XCLAIM (members
        known to be gone)
    ``dead_letter(delivery, reason)``                      XADD to the DLQ + XACK, atomically

Decisions (the contract other packages rely on):

- **Bad entries in a group** (undecodable bytes, unknown type, newer schema version, a type
  not in ``accept``, delivered more than ``max_deliveries`` times) are written to the DLQ
  stream as a :class:`~bus.messages.DeadLetter` (source stream, entry id, reason, raw bytes,
  deliveries, group, consumer) and XACKed in the same MULTI/EXEC. They are never returned.
- **Entries trimmed away while pending** are dead-lettered too, with reason
  :data:`TRIMMED_REASON` and empty ``raw`` (so nothing vanishes silently), and removed from
  the PEL. Both shapes are handled: Redis 7 XAUTOCLAIM's third reply element, Redis 6.2
  XAUTOCLAIM's nil placeholders, and XREADGROUP's nil fields when re-reading own pending.
- **Bad entries in read_all/tail** are skipped (logged at WARNING) and, when given, passed to
  ``on_bad(BadEntry)``; they are never dead-lettered there, because a log has many readers and
  each would write its own copy. Log readers never crash on garbage.
- **Deleted stream or group** → :class:`~bus.errors.StreamGone` / :class:`~bus.errors.GroupGone`
  (from the NOGROUP error), never a silent re-create, hang or retry.
- **Connection loss** → every command is retried with bounded exponential backoff + jitter
  (:class:`~bus.retry.RetryPolicy`, ~9 s in total by default), then
  :class:`~bus.errors.BusUnavailable` naming the redacted URL. A retried XADD may land twice
  (the reply, not the write, was lost): delivery is at-least-once and handlers are idempotent.
  A consumer that lost a read reply re-reads its own pending entries first.
- **No wait is unbounded**: every call (one command or one pipeline) has a deadline of
  ``op_timeout_s`` plus its ``block_ms``; a missed deadline counts as a connection failure
  (retried, then :class:`~bus.errors.BusUnavailable`). ``block_ms=0``/``None`` means *do not
  block* (unlike Redis, where 0 means forever). One deadline per round trip, not per reply,
  keeps pipelines cheap.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple, Self, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from bus.errors import (
    BusAuthError,
    BusError,
    BusUnavailable,
    Fenced,
    GroupGone,
    StreamGone,
    redact_url,
)
from bus.keys import RunKeys
from bus.messages import FIELD, DeadLetter, DecodeError, Message, decode, encode
from bus.retry import RetryPolicy, retry_async

__all__ = [
    "EXCEEDED_REASON",
    "TRIMMED_REASON",
    "BadEntry",
    "Bus",
    "Consumer",
    "ConsumerStats",
    "Delivery",
    "Entry",
    "GroupInfo",
    "default_dlq",
    "entry_key",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

TRIMMED_REASON = "trimmed while pending"
"""DeadLetter reason for a pending entry whose data was trimmed/deleted from the stream."""

EXCEEDED_REASON = "exceeded max deliveries"
"""DeadLetter reason for an entry delivered more than ``max_deliveries`` times."""

_RETRY_ON: tuple[type[BaseException], ...] = (
    RedisConnectionError,  # includes BusyLoadingError while a restarted server replays its AOF
    RedisTimeoutError,
    TimeoutError,
    OSError,
)
_NO_RETRY: tuple[type[BaseException], ...] = (AuthenticationError, AuthorizationError)

# Commands whose replies we parse ourselves: redis-py's parsers drop nil entries' ids and
# build a dict per entry, which is both lossy and slow on the hot path.
_RAW_COMMANDS = ("XREADGROUP", "XREAD", "XRANGE", "XREVRANGE", "XAUTOCLAIM", "XPENDING", "XCLAIM")

_MAX_ID = b"+"
_ENTRY_ID = re.compile(r"^\d+(-\d+)?$")


def _raw(response: Any, **options: Any) -> Any:
    return response


class Entry(NamedTuple):
    """One decoded stream entry."""

    id: str
    msg: Message


class Delivery(NamedTuple):
    """One entry handed to a group member; ``deliveries`` counts this delivery too."""

    id: str
    msg: Message
    deliveries: int
    stream: str


class BadEntry(NamedTuple):
    """An entry that could not be decoded (read_all/tail report these to ``on_bad``)."""

    stream: str
    id: str
    reason: str
    raw: bytes


class GroupInfo(NamedTuple):
    """One consumer group of a stream (XINFO GROUPS)."""

    name: str
    consumers: int
    pending: int
    last_delivered_id: str


@dataclass(slots=True)
class ConsumerStats:
    """Counters of one :class:`Consumer` (since it was created)."""

    delivered: int = 0
    acked: int = 0
    reclaimed: int = 0
    dead_lettered: int = 0
    trimmed: int = 0


def default_dlq(stream: str) -> str:
    """The DLQ of ``stream``: the run's ``dlq`` key for ``rlbus:{RUN}:...`` streams (same hash
    slot, so dead-lettering is one transaction), else ``stream + ":dlq"``."""
    if stream.startswith("rlbus:{") and "}" in stream:
        run_id = stream[len("rlbus:{") : stream.index("}")]
        try:
            return RunKeys(run_id).dlq
        except ValueError:
            pass
    return f"{stream}:dlq"


def _split_fields(fields: list[bytes] | None) -> bytes | None:
    """The FIELD value of a raw RESP2 field list (None when absent)."""
    if fields is None:
        return None
    # Fast path: our entries have exactly one field.
    if len(fields) == 2 and fields[0] == FIELD:
        return fields[1]
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == FIELD:
            return fields[i + 1]
    return None


def _raw_of(fields: list[bytes] | None) -> bytes:
    """Bytes to keep in a DeadLetter: the FIELD value, else all fields msgpack-encoded."""
    value = _split_fields(fields)
    if value is not None:
        return bytes(value)
    if not fields:
        return b""
    return msgspec.msgpack.encode(list(fields))


def entry_key(entry_id: str | bytes) -> tuple[int, int]:
    """An entry id as ``(ms, seq)``, so ids compare in stream order."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


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


# Atomic safe trim. KEYS[1] stream; ARGV[1] "maxlen" | "minid"; ARGV[2] value.
# The cut never passes any group's oldest pending entry nor its first undelivered entry.
_TRIM_LUA = _LUA_ID_ORDER + """
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then return 0 end
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

# Monotonic step barrier. KEYS[1] the barrier key; ARGV[1] the step. Never lowers it.
_SET_BARRIER_LUA = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local step = tonumber(ARGV[1])
if cur < step then
  redis.call('SET', KEYS[1], ARGV[1])
  return step
end
return cur
"""

# Guarded publish. KEYS[1] stream; KEYS[2] barrier key; ARGV[1] field; ARGV[2] encoded
# message; ARGV[3] first step. XADD only while the barrier is below the first step.
_PUBLISH_GUARDED_LUA = """
local barrier = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
if barrier < tonumber(ARGV[3]) then
  return redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
end
return false
"""


class Bus:
    """A Redis Streams client for one process. Build it with :meth:`from_url`."""

    def __init__(
        self,
        client: aioredis.Redis,
        url: str,
        *,
        retry: RetryPolicy | None = None,
        op_timeout_s: float = 30.0,
    ) -> None:
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s}")
        self._redis = client
        self.url = redact_url(url)
        """The URL with any password replaced by ``***``."""
        self.retry = retry or RetryPolicy()
        self.op_timeout_s = op_timeout_s
        """Deadline of one call (plus its block time), in seconds."""
        for name in _RAW_COMMANDS:
            client.set_response_callback(name, _raw)
        self._trim_script = client.register_script(_TRIM_LUA)
        self._trim_log_script = client.register_script(_TRIM_LOG_LUA)
        self._set_barrier_script = client.register_script(_SET_BARRIER_LUA)
        self._guarded_script = client.register_script(_PUBLISH_GUARDED_LUA)
        self.on_retry: Callable[[str, int, BaseException], None] | None = None
        """Optional hook ``(op, attempt, error)`` run before each retry wait (metrics, tests)."""

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        retry: RetryPolicy | None = None,
        op_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        client_name: str | None = None,
    ) -> Bus:
        """A bus on ``url`` (``redis://``, ``rediss://``, ``unix://``; user/password allowed).

        Connects lazily: the first command opens the connection (and is retried).
        """
        client = aioredis.Redis.from_url(
            url,
            decode_responses=False,
            protocol=2,  # reply shapes below are RESP2's
            # No per-reply socket timeout: _call puts one deadline on the whole round trip
            # (a per-reply timer costs ~10 us for each of a pipeline's 64 replies).
            socket_timeout=None,
            socket_connect_timeout=connect_timeout_s,
            # Our own RetryPolicy is the only retry layer; redis-py's would multiply it.
            retry=Retry(NoBackoff(), 0),
            client_name=client_name,
        )
        return cls(client, url, retry=retry, op_timeout_s=op_timeout_s)

    # ------------------------------------------------------------------ plumbing

    async def _call(
        self,
        op: str,
        fn: Callable[[], Awaitable[T]],
        on_retry: Callable[[int, BaseException], None] | None = None,
        block_ms: int | None = None,
    ) -> T:
        """Run ``fn`` under the retry policy, each try within ``op_timeout_s`` (+ the block
        time); map connection/auth failures to bus errors."""
        deadline_s = self.op_timeout_s + (block_ms or 0) / 1000

        async def attempt() -> T:
            # A cancelled redis-py read closes its connection, so no stale reply is left.
            async with asyncio.timeout(deadline_s):
                return await fn()

        def retrying(attempt: int, exc: BaseException) -> None:
            log.info("%s on %s failed (%s); retry %d", op, self.url, exc, attempt + 1)
            if on_retry is not None:
                on_retry(attempt, exc)
            if self.on_retry is not None:
                self.on_retry(op, attempt, exc)

        try:
            return await retry_async(
                self.retry, attempt, retry_on=_RETRY_ON, no_retry=_NO_RETRY, on_retry=retrying
            )
        except (AuthenticationError, AuthorizationError) as exc:
            raise BusAuthError(f"Redis at {self.url} refused the credentials: {exc}") from exc
        except _RETRY_ON as exc:
            raise BusUnavailable(self.url, op, self.retry.attempts, exc) from exc

    def _block_arg(self, block_ms: int | None) -> list[Any]:
        if not block_ms or block_ms <= 0:
            return []
        return ["BLOCK", int(block_ms)]

    async def close(self) -> None:
        """Close the client and its connections."""
        await self._redis.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"Bus({self.url!r})"

    async def ping(self) -> None:
        """Wraps PING (raises :class:`BusUnavailable` if Redis stays unreachable)."""
        await self._call("PING", lambda: self._redis.execute_command("PING"))

    async def server_time(self) -> float:
        """The Redis server's clock, in seconds since the epoch. Wraps TIME.

        Entry ids of ``XADD *`` are this clock in milliseconds, so an entry's age is
        ``server_time()`` minus its id's ms part: one clock, whatever the hosts' clocks say.
        """
        reply = await self._call("TIME", lambda: self._redis.execute_command("TIME"))
        seconds, micros = reply
        return int(seconds) + int(micros) / 1_000_000

    async def server_version(self) -> tuple[int, int, int]:
        """The server's version, from INFO server."""
        info = await self._call("INFO", lambda: self._redis.info("server"))
        parts = [int(p) for p in str(info["redis_version"]).split(".")[:3]]
        while len(parts) < 3:
            parts.append(0)
        return parts[0], parts[1], parts[2]

    # ------------------------------------------------------------------ publishing

    @staticmethod
    def _xadd_args(stream: str, data: bytes, maxlen: int | None) -> tuple[Any, ...]:
        if maxlen is None:
            return ("XADD", stream, "*", FIELD, data)
        # "~" lets Redis trim whole macro nodes: far cheaper than exact trimming.
        return ("XADD", stream, "MAXLEN", "~", maxlen, "*", FIELD, data)

    async def publish(self, stream: str, msg: Message, *, maxlen: int | None = None) -> str:
        """Append one message; returns its entry id. Wraps XADD.

        ``maxlen`` trims approximately (``MAXLEN ~``) and may drop unconsumed entries: use it
        only for streams no group depends on (e.g. heartbeats); see :meth:`trim_safely`.
        """
        args = self._xadd_args(stream, encode(msg), maxlen)
        entry_id: bytes = await self._call("XADD", lambda: self._redis.execute_command(*args))
        return entry_id.decode()

    async def publish_many(
        self,
        stream: str,
        msgs: Iterable[Message],
        *,
        atomic: bool = False,
        maxlen: int | None = None,
    ) -> list[str]:
        """Append many messages in one round trip (pipelined XADDs).

        ``atomic=True`` wraps them in MULTI/EXEC so they land together or not at all (a group
        of samples of one ticket).
        """
        return await self.publish_multi([(stream, m) for m in msgs], atomic=atomic, maxlen=maxlen)

    async def publish_multi(
        self,
        items: Iterable[tuple[str, Message]],
        *,
        atomic: bool = True,
        maxlen: int | None = None,
    ) -> list[str]:
        """Append ``(stream, msg)`` pairs, possibly to several streams, in one round trip.

        Wraps pipelined XADDs, in MULTI/EXEC when ``atomic`` (the default here: use it to
        publish e.g. samples and the event announcing them together; the streams must live in
        one hash slot on a cluster, which a run's keys do).
        """
        commands = [self._xadd_args(s, encode(m), maxlen) for s, m in items]
        if not commands:
            return []

        async def go() -> list[bytes]:
            pipe = self._redis.pipeline(transaction=atomic)
            for args in commands:
                pipe.execute_command(*args)
            return await pipe.execute()

        ids = await self._call("XADD", go)
        return [i.decode() for i in ids]

    async def publish_raw(self, stream: str, fields: Mapping[str | bytes, Any]) -> str:
        """Append an entry with arbitrary fields (tools and tests; bypasses encoding).
        Wraps XADD."""
        args: list[Any] = ["XADD", stream, "*"]
        for k, v in fields.items():
            args += [k, v]
        entry_id: bytes = await self._call("XADD", lambda: self._redis.execute_command(*args))
        return entry_id.decode()

    # ------------------------------------------------------------------ step barriers

    async def publish_guarded(
        self, stream: str, msg: Message, guard_key: str, first_step: int
    ) -> str | None:
        """Append ``msg`` only if the int at ``guard_key`` (0 when missing) is below
        ``first_step``; returns the entry id, or None when refused (nothing was written).

        Wraps one Lua script (EVALSHA, EVAL when the server does not have it yet: GET, then
        XADD), so the check and the write are atomic: an accepted entry was appended before
        any :meth:`set_barrier` that raised the key to ``first_step`` or above. ``stream``
        and ``guard_key`` must share a hash slot on a cluster (a run's keys do). As with
        :meth:`publish`, a retried call whose reply was lost may have written the entry
        even if the retry reports None (the barrier moved meanwhile): callers that care
        look for it in the stream.
        """
        data = encode(msg)
        step = int(first_step)
        entry_id: bytes | None = await self._call(
            "XADD",
            lambda: self._guarded_script(keys=[stream, guard_key], args=[FIELD, data, step]),
        )
        return None if entry_id is None else entry_id.decode()

    async def set_barrier(self, key: str, step: int) -> int:
        """Raise the int at ``key`` to ``step``; never lower it. Returns the value it holds
        afterwards (``step`` or a higher one already there).

        Wraps one Lua script (EVALSHA/EVAL: GET, then SET only if the value is lower), so
        concurrent callers cannot move it backwards.
        """
        value = await self._call(
            "SET", lambda: self._set_barrier_script(keys=[key], args=[int(step)])
        )
        return int(value)

    async def get_barrier(self, key: str) -> int:
        """The int at ``key``, 0 when it is missing. Wraps GET."""
        raw = await self._call("GET", lambda: self._redis.execute_command("GET", key))
        return 0 if raw is None else int(raw)

    # ------------------------------------------------------------------ reading logs

    def _decode_log_entry(
        self,
        stream: str,
        entry_id: bytes,
        fields: list[bytes] | None,
        on_bad: Callable[[BadEntry], None] | None,
    ) -> Entry | None:
        try:
            return Entry(entry_id.decode(), decode(_split_fields(fields)))
        except DecodeError as exc:
            bad = BadEntry(stream, entry_id.decode(), exc.reason, _raw_of(fields))
            log.warning("skipping bad entry %s of %s: %s", bad.id, stream, bad.reason)
            if on_bad is not None:
                on_bad(bad)
            return None

    async def read_all(
        self,
        stream: str,
        start: str = "0",
        end: str = "+",
        *,
        count: int = 500,
        on_bad: Callable[[BadEntry], None] | None = None,
    ) -> AsyncIterator[Entry]:
        """Every entry from ``start`` (inclusive) to ``end``, in order. Wraps XRANGE paging.

        Bad entries are skipped (see the module docstring). A missing stream yields nothing.
        """
        cursor: str | bytes = "-" if start in ("0", "0-0", "-") else start
        while True:
            page = await self._call(
                "XRANGE",
                lambda c=cursor: self._redis.execute_command(
                    "XRANGE", stream, c, end, "COUNT", count
                ),
            )
            for entry_id, fields in page:
                entry = self._decode_log_entry(stream, entry_id, fields, on_bad)
                if entry is not None:
                    yield entry
            if len(page) < count:
                return
            cursor = b"(" + page[-1][0]

    async def tail(
        self,
        stream: str,
        last_id: str = "$",
        *,
        block_ms: int = 1000,
        count: int = 100,
        on_bad: Callable[[BadEntry], None] | None = None,
        stop: asyncio.Event | None = None,
        idle_timeout_s: float | None = None,
    ) -> AsyncIterator[Entry]:
        """Entries after ``last_id`` as they arrive. Wraps XREAD BLOCK.

        ``last_id="$"``: only entries newer than the current last one (resolved once, so
        nothing published between two reads is missed). ``last_id="0"``: the whole log from
        its beginning, then new entries. Stops when ``stop`` is set or after
        ``idle_timeout_s`` without an entry; each wait is at most ``block_ms``.
        """
        cursor: str | bytes = last_id
        if last_id == "$":
            newest = await self._latest_id(stream)
            cursor = newest if newest is not None else b"0-0"
        block = self._block_arg(block_ms if block_ms > 0 else 1)
        idle_since = time.monotonic()
        while stop is None or not stop.is_set():
            reply = await self._call(
                "XREAD",
                lambda c=cursor: self._redis.execute_command(
                    "XREAD", "COUNT", count, *block, "STREAMS", stream, c
                ),
                block_ms=block_ms,
            )
            if reply:
                entries = reply[0][1]
                cursor = entries[-1][0]
                idle_since = time.monotonic()
                for entry_id, fields in entries:
                    entry = self._decode_log_entry(stream, entry_id, fields, on_bad)
                    if entry is not None:
                        yield entry
            elif idle_timeout_s is not None and time.monotonic() - idle_since >= idle_timeout_s:
                return

    async def read_after(
        self,
        stream: str,
        last_id: str,
        *,
        count: int = 100,
        block_ms: int | None = None,
        on_bad: Callable[[BadEntry], None] | None = None,
    ) -> tuple[list[Entry], str]:
        """One read of the entries after ``last_id``: ``(entries, cursor)``. Wraps XREAD.

        For poll loops: ``block_ms=None`` (or 0) returns at once, else waits at most that
        long. ``cursor`` is the id to pass next time; it moves past skipped bad entries too,
        so a garbage entry is never read twice. A missing stream gives ``([], last_id)``.
        """
        block = self._block_arg(block_ms)
        reply = await self._call(
            "XREAD",
            lambda: self._redis.execute_command(
                "XREAD", "COUNT", count, *block, "STREAMS", stream, last_id
            ),
            block_ms=block_ms,
        )
        if not reply:
            return [], last_id
        raw_entries = reply[0][1]
        entries = [
            entry
            for entry_id, fields in raw_entries
            if (entry := self._decode_log_entry(stream, entry_id, fields, on_bad)) is not None
        ]
        return entries, raw_entries[-1][0].decode()

    async def _latest_id(self, stream: str) -> bytes | None:
        reply = await self._call(
            "XREVRANGE",
            lambda: self._redis.execute_command("XREVRANGE", stream, "+", "-", "COUNT", 1),
        )
        return reply[0][0] if reply else None

    async def latest(self, stream: str) -> Entry | None:
        """The newest decodable entry, or None for an empty/missing stream.
        Wraps XREVRANGE COUNT 1 (walking back past undecodable entries)."""
        cursor: bytes = _MAX_ID
        while True:
            reply = await self._call(
                "XREVRANGE",
                lambda c=cursor: self._redis.execute_command(
                    "XREVRANGE", stream, c, "-", "COUNT", 16
                ),
            )
            for entry_id, fields in reply:
                entry = self._decode_log_entry(stream, entry_id, fields, None)
                if entry is not None:
                    return entry
            if len(reply) < 16:
                return None
            cursor = b"(" + reply[-1][0]

    async def read_ids(self, stream: str, ids: Sequence[str]) -> dict[str, Message]:
        """The entries with exactly these ids that still exist and decode: ``{id: msg}``.
        Wraps pipelined ``XRANGE stream id id`` (O(log n) each, however long the stream)."""
        if not ids:
            return {}
        redis_ = self._redis

        async def go() -> list[Any]:
            pipe = redis_.pipeline(transaction=False)
            for entry_id in ids:
                pipe.execute_command("XRANGE", stream, entry_id, entry_id)
            return await pipe.execute()

        found: dict[str, Message] = {}
        for page in await self._call("XRANGE", go):
            for entry_id, fields in page:
                entry = self._decode_log_entry(stream, entry_id, fields, None)
                if entry is not None:
                    found[entry.id] = entry.msg
        return found

    async def read_page(
        self, stream: str, after: str = "0", end: str = "+", *, count: int = 500
    ) -> tuple[str | None, list[tuple[str, list[bytes]]]]:
        """``(id of the stream's first entry, up to count raw entries after `after`)``, both
        as of one instant: wraps ``XRANGE stream - + COUNT 1`` and ``XRANGE stream (after end
        COUNT count`` in one MULTI/EXEC. ``after="0"`` starts at the beginning; ``end`` may
        be exclusive (``"(ID"``). Entries keep their raw fields (for archiving, or to tell
        what was trimmed between two reads: entries before the first one are gone)."""
        start = "-" if after in ("0", "0-0", "-") else f"({after}"
        redis_ = self._redis

        async def go() -> list[Any]:
            pipe = redis_.pipeline(transaction=True)
            pipe.execute_command("XRANGE", stream, "-", "+", "COUNT", 1)
            pipe.execute_command("XRANGE", stream, start, end, "COUNT", count)
            return await pipe.execute()

        head, page = await self._call("XRANGE", go)
        first = head[0][0].decode() if head else None
        return first, [(entry_id.decode(), list(fields or [])) for entry_id, fields in page]

    def decode_entry(
        self, stream: str, entry_id: str, fields: list[bytes],
        on_bad: Callable[[BadEntry], None] | None = None,
    ) -> Entry | None:
        """A raw entry (from :meth:`read_page` or the archive) decoded as :meth:`read_all`
        decodes it: None for a bad one (logged, passed to ``on_bad``). Plain function."""
        return self._decode_log_entry(stream, entry_id.encode(), fields, on_bad)

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
        if not _ENTRY_ID.match(minid):
            raise ValueError(f"minid must be an entry id like '1700000000000-0', got {minid!r}")
        keys = [stream, fence[0] if fence else stream]
        for position_key, alive_key in readers:
            keys += [position_key, alive_key]
        token = fence[1] if fence else ""
        removed = int(await self._call(
            "XTRIM", lambda: self._trim_log_script(keys=keys, args=[minid, token])
        ))
        if removed < 0 and fence is not None:
            holder = await self._call(
                "GET", lambda: self._redis.execute_command("GET", fence[0]))
            raise Fenced(fence[0], fence[1], None if holder is None else _text(holder))
        return removed

    async def set_position(self, key: str, entry_id: str) -> None:
        """Store a reader's position in a log (an entry id it needs kept, see
        :meth:`trim_log`). Wraps SET."""
        if not _ENTRY_ID.match(entry_id):
            raise ValueError(f"not an entry id: {entry_id!r}")
        await self._call("SET", lambda: self._redis.execute_command("SET", key, entry_id))

    async def set_text(self, key: str, value: str) -> None:
        """Store a small text value (a path, a note). Wraps SET."""
        await self._call("SET", lambda: self._redis.execute_command("SET", key, value))

    async def get_text(self, key: str) -> str | None:
        """The text at ``key`` (None when missing). Wraps GET."""
        raw = await self._call("GET", lambda: self._redis.execute_command("GET", key))
        return None if raw is None else _text(raw)

    async def reader_floor(self, readers: Sequence[tuple[str, str]]) -> str | None:
        """The lowest position among ``readers`` (``(position key, liveness key)``) whose
        liveness key exists; None when none holds one. Wraps GET and EXISTS (pipelined)."""
        if not readers:
            return None
        redis_ = self._redis

        async def go() -> list[Any]:
            pipe = redis_.pipeline(transaction=True)
            for position_key, alive_key in readers:
                pipe.execute_command("GET", position_key)
                pipe.execute_command("EXISTS", alive_key)
            return await pipe.execute()

        replies = await self._call("GET", go)
        floor: str | None = None
        for position, alive in zip(replies[::2], replies[1::2], strict=True):
            if position is None or not int(alive):
                continue
            text = _text(position)
            if _ENTRY_ID.match(text) and (floor is None or entry_key(text) < entry_key(floor)):
                floor = text
        return floor

    async def length(self, stream: str) -> int:
        """Number of entries. Wraps XLEN."""
        return int(await self._call("XLEN", lambda: self._redis.execute_command("XLEN", stream)))

    # ------------------------------------------------------------------ admin

    async def groups(self, stream: str) -> list[GroupInfo]:
        """The consumer groups of ``stream`` ([] when the stream does not exist).
        Wraps XINFO GROUPS."""
        try:
            raw = await self._call("XINFO", lambda: self._redis.xinfo_groups(stream))
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return []
            raise
        return [
            GroupInfo(
                name=_text(g["name"]),
                consumers=int(g["consumers"]),
                pending=int(g["pending"]),
                last_delivered_id=_text(g["last-delivered-id"]),
            )
            for g in raw
        ]

    async def consumers(self, stream: str, group: str) -> list[str]:
        """Names of the members of ``group`` ([] when the stream or group is missing).
        Wraps XINFO CONSUMERS."""
        try:
            raw = await self._call(
                "XINFO", lambda: self._redis.execute_command("XINFO", "CONSUMERS", stream, group)
            )
        except ResponseError as exc:
            if "no such key" in str(exc).lower() or str(exc).startswith("NOGROUP"):
                return []
            raise
        names = []
        for row in raw:
            fields = dict(zip(row[::2], row[1::2], strict=False)) if isinstance(row, list) else row
            name = fields.get(b"name", fields.get("name"))
            names.append(_text(name))
        return names

    async def scan(self, pattern: str) -> list[str]:
        """Every key matching ``pattern``, sorted. Wraps SCAN MATCH (cursor loop)."""

        async def go() -> set[bytes]:
            keys: set[bytes] = set()
            cursor: Any = 0
            while True:
                cursor, batch = await self._redis.execute_command(
                    "SCAN", cursor, "MATCH", pattern, "COUNT", 1000
                )
                keys.update(batch)
                if int(cursor) == 0:
                    return keys

        return sorted(_text(k) for k in await self._call("SCAN", go))

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
        if minid is not None and not _ENTRY_ID.match(minid):
            raise ValueError(f"minid must be an entry id like '1700000000000-0', got {minid!r}")
        mode, value = ("maxlen", str(maxlen)) if maxlen is not None else ("minid", str(minid))
        removed = await self._call(
            "XTRIM", lambda: self._trim_script(keys=[stream], args=[mode, value])
        )
        return int(removed)

    async def destroy_group(self, stream: str, group: str) -> bool:
        """Delete a consumer group; True if it existed. Wraps XGROUP DESTROY."""
        try:
            n = await self._call(
                "XGROUP",
                lambda: self._redis.execute_command("XGROUP", "DESTROY", stream, group),
            )
        except ResponseError as exc:
            if "requires the key to exist" in str(exc):
                return False
            raise
        return bool(n)

    async def delete(self, *keys: str) -> int:
        """Delete keys (streams, blob chunks); returns how many existed. Wraps DEL."""
        if not keys:
            return 0
        return int(await self._call("DEL", lambda: self._redis.execute_command("DEL", *keys)))

    async def exists(self, key: str) -> bool:
        """Whether ``key`` exists. Wraps EXISTS."""
        return bool(await self._call("EXISTS", lambda: self._redis.execute_command("EXISTS", key)))

    async def command(self, *args: Any) -> Any:
        """Run one raw Redis command under the retry policy (tools, tests; bytes replies)."""
        return await self._call(str(args[0]).upper(), lambda: self._redis.execute_command(*args))

    async def pending_owners(self, stream: str, group: str, count: int) -> dict[str, str]:
        """Entry id -> consumer of up to ``count`` pending entries. Wraps XPENDING."""
        rows = await self.command("XPENDING", stream, group, "-", "+", count)
        return {row[0].decode(): row[1].decode() for row in rows or []}

    def consumer(self, stream: str, group: str, name: str, **kwargs: Any) -> Consumer:
        """A :class:`Consumer` of ``stream`` as member ``name`` of ``group``."""
        return Consumer(self, stream, group, name, **kwargs)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Consumer:
    """One member ``name`` of consumer group ``group`` on ``stream``.

    Handlers XACK (:meth:`ack`) only after a message's effect is durable. Entries that cannot
    be handled go to ``dlq_stream`` (default :func:`default_dlq`). ``accept`` optionally
    restricts the message types this stream may carry; others are dead-lettered.
    ``min_idle_ms`` is the default idleness after which :meth:`reclaim` takes an entry over
    from another (presumably dead) member.
    """

    def __init__(
        self,
        bus: Bus,
        stream: str,
        group: str,
        name: str,
        *,
        max_deliveries: int = 5,
        min_idle_ms: int = 60_000,
        dlq_stream: str | None = None,
        accept: tuple[type, ...] | None = None,
    ) -> None:
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {max_deliveries}")
        self.bus = bus
        self.stream = stream
        self.group = group
        self.name = name
        self.max_deliveries = max_deliveries
        self.min_idle_ms = min_idle_ms
        self.dlq_stream = dlq_stream or default_dlq(stream)
        self.accept = accept
        self.stats = ConsumerStats()
        # Start by re-reading our own pending entries (a restarted member picks up its work).
        self._backlog = True
        self._cursor: bytes = b"0-0"
        # Ids handed out by this object and not acked yet: a backlog re-read skips them so an
        # entry is not handed out twice by the same process.
        self._inflight: set[str] = set()

    def __repr__(self) -> str:
        return f"Consumer({self.stream!r}, group={self.group!r}, name={self.name!r})"

    @property
    def inflight(self) -> int:
        """Entries handed out by this consumer and not acked yet."""
        return len(self._inflight)

    async def _call(
        self,
        op: str,
        fn: Callable[[], Awaitable[T]],
        on_retry: Callable[[int, BaseException], None] | None = None,
        block_ms: int | None = None,
    ) -> T:
        try:
            return await self.bus._call(op, fn, on_retry, block_ms)
        except ResponseError as exc:
            if str(exc).startswith("NOGROUP"):
                raise await self._gone() from exc
            raise

    async def _gone(self) -> BusError:
        if not await self.bus.exists(self.stream):
            return StreamGone(self.stream, self.group)
        return GroupGone(self.stream, self.group)

    def _lost_reply(self, attempt: int, exc: BaseException) -> None:
        # A read whose reply was lost may have delivered entries to us: find them in our PEL.
        self._backlog = True
        self._cursor = b"0-0"

    async def ensure_group(self, start_id: str = "0") -> bool:
        """Create the group (and the stream) if missing; True if it was created.
        Wraps XGROUP CREATE ... MKSTREAM (BUSYGROUP means it exists: fine)."""
        try:
            await self.bus._call(
                "XGROUP",
                lambda: self.bus._redis.execute_command(
                    "XGROUP", "CREATE", self.stream, self.group, start_id, "MKSTREAM"
                ),
            )
        except ResponseError as exc:
            if str(exc).startswith("BUSYGROUP"):
                return False
            raise
        return True

    # ------------------------------------------------------------------ reading

    async def read(self, count: int = 64, block_ms: int | None = 1000) -> list[Delivery]:
        """Up to ``count`` deliveries: own pending entries first (id ``0``), then new ones
        (``>``, waiting at most ``block_ms``). Wraps XREADGROUP.

        Returns [] when nothing arrived in time. Bad entries are dead-lettered, not returned.
        """
        if self._backlog:
            out = await self._read_backlog(count)
            if out:
                return out
        return await self._read_new(count, block_ms)

    async def _xreadgroup(self, count: int, block: list[Any], start: bytes | str) -> Any:
        redis_ = self.bus._redis
        return await self._call(
            "XREADGROUP",
            lambda: redis_.execute_command(
                "XREADGROUP",
                "GROUP",
                self.group,
                self.name,
                "COUNT",
                count,
                *block,
                "STREAMS",
                self.stream,
                start,
            ),
            on_retry=self._lost_reply,
            block_ms=block[1] if block else None,
        )

    async def _read_new(self, count: int, block_ms: int | None) -> list[Delivery]:
        try:
            reply = await self._xreadgroup(count, self.bus._block_arg(block_ms), ">")
        except BusUnavailable:
            self._lost_reply(0, BusError())
            raise
        if not reply:
            return []
        stream = self.stream
        accept = self.accept
        inflight = self._inflight
        out: list[Delivery] = []
        bad: list[tuple[str, str, bytes, int]] = []
        for entry_id, fields in reply[0][1]:
            eid = entry_id.decode()
            # Inlined _split_fields fast path: this loop is the consumer's hot path.
            if fields is not None and len(fields) == 2 and fields[0] == FIELD:
                raw = fields[1]
            else:
                raw = _split_fields(fields)
            try:
                msg = decode(raw)
            except DecodeError as exc:
                bad.append((eid, exc.reason, _raw_of(fields), 1))
                continue
            if accept is not None and not isinstance(msg, accept):
                bad.append((eid, _unexpected(msg, stream), _raw_of(fields), 1))
                continue
            inflight.add(eid)
            out.append(Delivery(eid, msg, 1, stream))
        if bad:
            await self._dead_letter_many(bad)
        self.stats.delivered += len(out)
        return out

    async def _read_backlog(self, count: int) -> list[Delivery]:
        while True:
            reply = await self._xreadgroup(count, [], self._cursor)
            entries = reply[0][1] if reply else []
            if not entries:
                self._backlog = False
                self._cursor = b"0-0"
                return []
            self._cursor = entries[-1][0]
            fresh = [(i.decode(), f) for i, f in entries if i.decode() not in self._inflight]
            if not fresh:
                continue
            counts = await self._delivery_counts([i for i, _ in fresh])
            out = await self._redelivered(fresh, counts)
            if out:
                return out

    async def _delivery_counts(self, ids: Sequence[str]) -> dict[str, int]:
        """Delivery counters of our pending ``ids``. Wraps XPENDING (one range per entry,
        pipelined: our PEL may interleave other entries in the same id range)."""
        if not ids:
            return {}

        async def go() -> list[Any]:
            pipe = self.bus._redis.pipeline(transaction=False)
            for i in ids:
                pipe.execute_command("XPENDING", self.stream, self.group, i, i, 1)
            return await pipe.execute()

        counts: dict[str, int] = {}
        for row in await self._call("XPENDING", go):
            if row:
                entry_id, _consumer, _idle, delivered = row[0]
                counts[entry_id.decode()] = int(delivered)
        return counts

    async def _redelivered(
        self, entries: Sequence[tuple[str, list[bytes] | None]], counts: Mapping[str, int]
    ) -> list[Delivery]:
        """Deliveries for re-delivered (backlog or reclaimed) entries; bad ones go to the DLQ:
        nil fields (trimmed), over ``max_deliveries``, undecodable or unexpected type."""
        out: list[Delivery] = []
        bad: list[tuple[str, str, bytes, int]] = []
        trimmed = 0
        for eid, fields in entries:
            # An id missing from XPENDING was acked meanwhile by someone else: skip it.
            n = counts.get(eid)
            if n is None:
                continue
            if fields is None:
                bad.append((eid, TRIMMED_REASON, b"", n))
                trimmed += 1
                continue
            if n > self.max_deliveries:
                bad.append(
                    (eid, f"{EXCEEDED_REASON} ({n} > {self.max_deliveries})", _raw_of(fields), n)
                )
                continue
            try:
                msg = decode(_split_fields(fields))
            except DecodeError as exc:
                bad.append((eid, exc.reason, _raw_of(fields), n))
                continue
            if self.accept is not None and not isinstance(msg, self.accept):
                bad.append((eid, _unexpected(msg, self.stream), _raw_of(fields), n))
                continue
            self._inflight.add(eid)
            out.append(Delivery(eid, msg, n, self.stream))
        if bad:
            await self._dead_letter_many(bad)
        self.stats.trimmed += trimmed
        self.stats.delivered += len(out)
        return out

    # ------------------------------------------------------------------ acking

    async def ack(self, *ids: str | Delivery) -> int:
        """Acknowledge entries (by id or Delivery); returns how many were pending.
        Wraps XACK."""
        if not ids:
            return 0
        keys = [i.id if isinstance(i, Delivery) else i for i in ids]
        n = await self._call(
            "XACK",
            lambda: self.bus._redis.execute_command("XACK", self.stream, self.group, *keys),
        )
        self._inflight.difference_update(keys)
        self.stats.acked += int(n)
        return int(n)

    async def publish_and_ack(
        self, stream: str, msgs: Sequence[Message], *ids: str | Delivery
    ) -> list[str]:
        """Append ``msgs`` to ``stream`` and acknowledge ``ids`` of this consumer's stream
        in one MULTI/EXEC (XADD ... XACK): the answers land and the work they answer is
        done together, in one round trip. Returns the new entry ids."""
        keys = [i.id if isinstance(i, Delivery) else i for i in ids]
        added, acked = await self._add_and_ack("XADD+XACK", stream, [encode(m) for m in msgs],
                                               keys)
        self.stats.acked += acked
        return added

    async def _add_and_ack(
        self, op: str, stream: str, payloads: Sequence[bytes], ids: Sequence[str]
    ) -> tuple[list[str], int]:
        """MULTI; XADD stream (one entry per payload); XACK this group's ``ids``; EXEC.
        Returns the new entry ids and how many of ``ids`` were pending."""
        commands = [self.bus._xadd_args(stream, data, None) for data in payloads]

        async def go() -> list[Any]:
            pipe = self.bus._redis.pipeline(transaction=True)
            for args in commands:
                pipe.execute_command(*args)
            if ids:
                pipe.execute_command("XACK", self.stream, self.group, *ids)
            return await pipe.execute()

        replies = await self._call(op, go)
        self._inflight.difference_update(ids)
        return ([r.decode() for r in replies[: len(commands)]],
                int(replies[-1]) if ids else 0)

    def acked(self, ids: Iterable[str]) -> None:
        """Record that ``ids`` were acked by another call than :meth:`ack` (e.g. inside a
        fenced script together with the event that justifies the ack)."""
        keys = list(ids)
        self._inflight.difference_update(keys)
        self.stats.acked += len(keys)

    async def dead_letter(self, entry: str | Delivery, reason: str, raw: bytes = b"") -> None:
        """Give up on an entry: write a DeadLetter with ``reason`` and XACK it, atomically
        (XADD to the DLQ + XACK in MULTI/EXEC). For handlers that find a message invalid.
        ``raw`` defaults to the re-encoded message of a Delivery."""
        if isinstance(entry, Delivery):
            eid, n = entry.id, entry.deliveries
            raw = raw or encode(entry.msg)
        else:
            eid, n = entry, 1
        await self._dead_letter_many([(eid, reason, raw, n)])

    async def _dead_letter_many(self, items: Sequence[tuple[str, str, bytes, int]]) -> None:
        """Wraps MULTI; XADD dlq (one DeadLetter per item); XACK stream group ids; EXEC."""
        letters = [
            encode(DeadLetter(source_stream=self.stream, entry_id=eid, reason=reason, raw=raw,
                              deliveries=n, group=self.group, consumer=self.name))
            for eid, reason, raw, n in items
        ]
        for eid, reason, _, _ in items:
            log.warning(
                "dead-lettering %s of %s (group %s): %s", eid, self.stream, self.group, reason
            )
        await self._add_and_ack("DLQ", self.dlq_stream, letters,
                                [eid for eid, _, _, _ in items])
        self.stats.dead_lettered += len(items)

    # ------------------------------------------------------------------ reclaiming

    async def reclaim(self, min_idle_ms: int | None = None, count: int = 100) -> list[Delivery]:
        """Take over entries pending (on any member) for at least ``min_idle_ms`` (default
        ``self.min_idle_ms``), walking the whole PEL. Wraps XAUTOCLAIM (cursor loop) and
        XPENDING (delivery counters).

        Entries trimmed while pending and entries over ``max_deliveries`` are dead-lettered.
        """
        idle = self.min_idle_ms if min_idle_ms is None else min_idle_ms
        cursor: bytes = b"0-0"
        out: list[Delivery] = []
        while True:
            start = cursor
            reply = await self._call(
                "XAUTOCLAIM",
                lambda s=start: self.bus._redis.execute_command(
                    "XAUTOCLAIM", self.stream, self.group, self.name, idle, s, "COUNT", count
                ),
            )
            cursor = reply[0]
            claimed = reply[1] or []
            # Redis >= 7: ids of deleted entries come third (already dropped from the PEL).
            gone = [i.decode() for i in (reply[2] if len(reply) > 2 else [])]
            live = [(e[0].decode(), e[1]) for e in claimed if e is not None and e[1] is not None]
            if len(live) < len(claimed):
                # Redis 6.2: a deleted entry is a nil in the reply and stays pending (now ours).
                gone += await self._find_deleted(start, cursor, {i for i, _ in live})
            entries: list[tuple[str, list[bytes] | None]] = [*live, *((g, None) for g in gone)]
            counts = await self._delivery_counts([i for i, _ in live])
            for g in gone:
                counts.setdefault(g, 1)  # Redis 7 already forgot its counter
            entries.sort(key=lambda e: entry_key(e[0]))
            got = await self._redelivered(entries, counts)
            self.stats.reclaimed += len(got)
            out += got
            if cursor == b"0-0":
                return out

    async def reclaim_from(self, owners: Iterable[str], count: int = 100) -> list[Delivery]:
        """Take over every entry pending on the members ``owners`` (members known to be gone,
        e.g. whose liveness key lapsed), however recently they were delivered: a slow but
        live member keeps its work. Wraps XPENDING (per owner) and XCLAIM.

        Entries trimmed while pending and entries over ``max_deliveries`` are dead-lettered.
        """
        out: list[Delivery] = []
        redis_ = self.bus._redis
        for owner in owners:
            if owner == self.name:
                continue
            while True:
                rows = await self._call(
                    "XPENDING",
                    lambda o=owner: redis_.execute_command(
                        "XPENDING", self.stream, self.group, "-", "+", count, o
                    ),
                )
                ids = [row[0] for row in rows or []]
                if not ids:
                    break
                claimed = await self._call(
                    "XCLAIM",
                    lambda ids=ids: redis_.execute_command(
                        "XCLAIM", self.stream, self.group, self.name, 0, *ids
                    ),
                )
                got = {e[0]: e[1] for e in claimed or [] if e is not None}
                # An id XCLAIM did not return was deleted (trimmed) while pending.
                entries = [(i.decode(), got.get(i)) for i in ids]
                counts = await self._delivery_counts([i for i, f in entries if f is not None])
                for i, f in entries:
                    if f is None:
                        counts.setdefault(i, 1)
                batch = await self._redelivered(entries, counts)
                self.stats.reclaimed += len(batch)
                out += batch
                if len(ids) < count:
                    break
        return out

    async def _find_deleted(self, start: bytes, next_cursor: bytes, live: set[str]) -> list[str]:
        """Ids in our PEL within [start, next_cursor) whose entries no longer exist.
        Wraps XPENDING (range, this consumer) and XRANGE id id (existence)."""
        end: bytes = b"+" if next_cursor == b"0-0" else b"(" + next_cursor
        lo: bytes = start
        candidates: list[str] = []
        while True:
            rows = await self._call(
                "XPENDING",
                lambda lo=lo: self.bus._redis.execute_command(
                    "XPENDING", self.stream, self.group, lo, end, 1000, self.name
                ),
            )
            candidates += [r[0].decode() for r in rows if r[0].decode() not in live]
            if len(rows) < 1000:
                break
            lo = b"(" + rows[-1][0]
        if not candidates:
            return []

        async def go() -> list[Any]:
            pipe = self.bus._redis.pipeline(transaction=False)
            for c in candidates:
                pipe.execute_command("XRANGE", self.stream, c, c)
            return await pipe.execute()

        found = await self._call("XRANGE", go)
        return [c for c, rows in zip(candidates, found, strict=True) if not rows]


def _unexpected(msg: Message, stream: str) -> str:
    return f"unexpected message type {type(msg).__name__} on {stream}"
