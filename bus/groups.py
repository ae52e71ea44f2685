"""Consumer groups: work shared among a group's members, each entry acked once it is done.

A :class:`Consumer` is one member of one group on one stream; :class:`GroupCommands`
(:mod:`bus.group_admin`) holds the group-level calls of :class:`~bus.streams.Bus` (list
groups and members, who holds which pending entry, destroy a group). The Lua body of each
fenced call is beside the method that runs it.

Decisions (the contract other packages rely on):

- **Bad entries in a group** (undecodable bytes, unknown type, newer schema version, a type
  not in ``accept``, delivered more than ``max_deliveries`` times) are written to the DLQ
  stream as a :class:`~runschema.messages.DeadLetter` (source stream, entry id, reason, raw bytes,
  deliveries, group, consumer) and XACKed in the same script, one per batch (a read's bad
  entries, or a handler's refusals, :meth:`Consumer.dead_letter_many`): refusing a flood of
  junk costs one round trip per read, not one per entry. They are never returned.
- **The dead-letter stream is capped**: each batch ends with ``XTRIM MAXLEN ~ dlq_max``
  (:data:`~bus.keys.DLQ_MAXLEN` by default, ``redis.dead_letter_max``), and the number of
  older dead letters it trimmed is added to the counter :func:`~bus.keys.dlq_dropped_key`
  in the same script, so what was dropped is known.
- **Refusals are said per interval**, never per entry (:class:`~bus.refusals.RefusalTally`):
  one log line at most every ``refusal_log_s`` with the counts by kind.
- **Entries trimmed away while pending** are dead-lettered too, with reason
  :data:`TRIMMED_REASON` and empty ``raw`` (so nothing vanishes silently), and removed from
  the PEL. Both shapes are handled: Redis 7 XAUTOCLAIM's third reply element, Redis 6.2
  XAUTOCLAIM's nil placeholders, and XREADGROUP's nil fields when re-reading own pending.
- **Deleted stream or group** → :class:`~bus.errors.StreamGone` / :class:`~bus.errors.GroupGone`
  (from the NOGROUP error), never a silent re-create, hang or retry.
- **A lost read reply** (the read was retried, see :mod:`bus.client`) may have delivered
  entries to us: the consumer re-reads its own pending entries first.
- **A fenced member** (``Consumer(..., fence=lease)``, the trainer's): every call that
  changes the group (read, ack, dead-letter, claim) is one Lua script behind the fence's
  token check (:meth:`bus.liveness.Lease.run_fenced`), so a member whose lease was taken
  cannot take, ack or dead-letter one entry (:class:`~bus.errors.Fenced`). Scripts cannot
  block (Redis refuses XREADGROUP BLOCK there): the wait for new entries is a plain XREAD
  BLOCK, which reads but delivers nothing. :meth:`Consumer.adopt` moves the entries of the
  group's other members (earlier incarnations, named by their epochs) to this one and
  removes those members.
- **A read can bring another stream's news with it** (:meth:`Consumer.read_then`): a fenced
  read that delivers something reads a second stream of the run (same hash slot) after a
  position in the same script, so what that stream held when the entries were delivered
  comes in the same round trip (the trainer: the ticket claims stated before the samples).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

from redis.exceptions import ResponseError

from bus.client import Arg, BusClient, Reply, block_args
from bus.entries import Entry, decode_fields, entry_key, raw_of, split_fields
from bus.errors import BusError, BusUnavailable
from bus.group_admin import GroupCommands, GroupInfo, in_group, member_names
from bus.keys import DLQ_MAXLEN, RunKeys, dlq_dropped_key
from bus.publish import xadd_args
from bus.refusals import REFUSAL_LOG_S, Refusal, RefusalTally, refusal_kind
from bus.retry import RetryHook
from runschema.messages import FIELD, DeadLetter, DecodeError, Message, decode, encode

__all__ = [
    "EXCEEDED_REASON",
    "TRIMMED_REASON",
    "Consumer",
    "ConsumerStats",
    "Delivery",
    "Fence",
    "GroupCommands",
    "GroupInfo",
    "Then",
    "ThenRead",
    "default_dlq",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

TRIMMED_REASON = "trimmed while pending"
"""DeadLetter reason for a pending entry whose data was trimmed/deleted from the stream."""

EXCEEDED_REASON = "exceeded max deliveries"
"""DeadLetter reason for an entry delivered more than ``max_deliveries`` times."""

UNEXPECTED_KIND = "unexpected message type"
"""What an entry of a type its stream does not ``accept`` is counted as (log lines)."""


class _Bad(NamedTuple):
    """One entry to dead-letter: id, reason, bytes kept, deliveries, kind (log counts)."""

    id: str
    reason: str
    raw: bytes
    deliveries: int
    kind: str


class Delivery(NamedTuple):
    """One entry handed to a group member; ``deliveries`` counts this delivery too."""

    id: str
    msg: Message
    deliveries: int
    stream: str


class Then(NamedTuple):
    """A read to make after a read that delivers entries, in the same script: ``stream``'s
    entries after ``after``, at most ``limit`` (:meth:`Consumer.read_then`)."""

    stream: str
    after: str
    limit: int


class ThenRead(NamedTuple):
    """What a :class:`Then` read found: the entries (garbage passed over, logged), the id to
    read after next time and whether it returned ``limit`` entries (more may follow)."""

    entries: list[Entry]
    cursor: str
    full: bool


@dataclass(slots=True)
class ConsumerStats:
    """Counters of one :class:`Consumer` (since it was created)."""

    delivered: int = 0
    acked: int = 0
    reclaimed: int = 0
    dead_lettered: int = 0
    trimmed: int = 0


class Fence(Protocol):
    """What fences a :class:`Consumer`'s group calls: :class:`bus.liveness.Lease` (or a
    wrapper of it, such as the trainer's writer). ``run_fenced`` runs the Lua ``body`` only
    while the fence holds; the body's keys start at KEYS[3], its args at ARGV[3]
    (:data:`bus.liveness.FENCE_LUA`); it raises :class:`~bus.errors.Fenced` otherwise."""

    async def run_fenced(
        self, body: str, keys: Sequence[str], args: Sequence[Arg], *, op: str = "EVAL",
        on_retry: RetryHook | None = None,
    ) -> Reply: ...


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


class Consumer:
    """One member ``name`` of consumer group ``group`` on ``stream``.

    Handlers XACK (:meth:`ack`) only after a message's effect is durable. Entries that cannot
    be handled go to ``dlq_stream`` (default :func:`default_dlq`). ``accept`` optionally
    restricts the message types this stream may carry; others are dead-lettered.
    ``min_idle_ms`` is the default idleness after which :meth:`reclaim` takes an entry over
    from another (presumably dead) member. With ``fence``, every call that changes the group
    runs behind it (see the module docstring). ``dlq_max``: about how many dead letters
    the DLQ keeps; ``refusal_log_s``: seconds between two lines about refused entries.
    """

    def __init__(
        self,
        bus: BusClient,
        stream: str,
        group: str,
        name: str,
        *,
        max_deliveries: int = 5,
        min_idle_ms: int = 60_000,
        dlq_stream: str | None = None,
        accept: tuple[type, ...] | None = None,
        fence: Fence | None = None,
        dlq_max: int = DLQ_MAXLEN,
        refusal_log_s: float = REFUSAL_LOG_S,
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
        self.dlq_max = dlq_max
        self.tally = RefusalTally(stream, group, refusal_log_s)
        self.accept = accept
        self.fence = fence
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

    async def _run(self, reply: Awaitable[T]) -> T:
        """``await reply``, a call on our group (NOGROUP → StreamGone / GroupGone)."""
        return await in_group(self.bus, self.stream, self.group, reply)

    # The fenced calls' Lua bodies run behind a fence (bus.liveness.FENCE_LUA): own keys from
    # KEYS[3], args from ARGV[3]. redis.pcall + returning the error keeps Redis's own error
    # ("NOGROUP ...") as the reply on every server version (6.2 wraps a raised one in
    # "ERR Error running script").

    # One command, ARGV[3..] (its keys are among KEYS[3..]).
    _CALL_LUA = "return redis.pcall(unpack(ARGV, 3))"

    async def _call(self, *args: Arg) -> Reply:
        """One command on our group (``args[0]`` names it), behind the fence if we have one.
        Wraps the command, or EVAL (the fence's checks, then the command)."""
        if self.fence is None:
            return await self._run(self.bus.command(*args))
        return await self._script(self._CALL_LUA, [], args, op=str(args[0]))

    async def _script(
        self, body: str, keys: Sequence[str], args: Sequence[Arg], *, op: str,
        on_retry: RetryHook | None = None,
    ) -> Reply:
        """Run a fenced-script ``body`` on our stream (KEYS[3]) and ``keys`` after it:
        behind the fence, or, without one, with its two slots unused. Wraps EVAL."""
        keys = [self.stream, *keys]
        if self.fence is not None:
            return await self._run(
                self.fence.run_fenced(body, keys, args, op=op, on_retry=on_retry))
        return await self._run(self.bus.run_script(
            body, [self.stream, self.stream, *keys], ["", "", *args], op=op, on_retry=on_retry))

    def _lost_reply(self, attempt: int, exc: BaseException) -> None:
        # A read whose reply was lost may have delivered entries to us: find them in our PEL.
        self._backlog = True
        self._cursor = b"0-0"

    async def ensure_group(self, start_id: str = "0") -> bool:
        """Create the group (and the stream) if missing; True if it was created.
        Wraps XGROUP CREATE ... MKSTREAM (BUSYGROUP means it exists: fine)."""
        try:
            await self.bus.command(
                "XGROUP", "CREATE", self.stream, self.group, start_id, "MKSTREAM"
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
        return (await self.read_then(None, count, block_ms))[0]

    async def read_then(self, then: Then | None, count: int = 64, block_ms: int | None = 1000
                        ) -> tuple[list[Delivery], ThenRead | None]:
        """:meth:`read`, and ``then``'s read made in the same script right after entries
        were delivered: what ``then.stream`` held at that moment. The second is None when it
        was not made (nothing delivered, own pending entries re-read, an unfenced member,
        or a lost reply): the caller reads that stream itself. Wraps EVAL (XREADGROUP,
        XREAD)."""
        self._say_refusals()  # counts of a flood that stopped are said within an interval
        if self._backlog:
            out = await self._read_backlog(count)
            if out:
                return out, None
        return await self._read_new(count, block_ms, then)

    async def _xreadgroup(self, count: int, block_ms: int | None, start: bytes | str,
                          then: Then | None = None) -> tuple[Reply, Reply]:
        """The XREADGROUP reply, and ``then``'s XREAD reply when it was read with it."""
        if self.fence is not None:
            return await self._fenced_read(count, block_ms, start, then)
        block = block_args(block_ms)
        return await self._run(self.bus.command(
            "XREADGROUP", "GROUP", self.group, self.name, "COUNT", count, *block,
            "STREAMS", self.stream, start,
            block_ms=int(block[1]) if block else None,
            on_retry=self._lost_reply,
        )), None

    # XREADGROUP GROUP ARGV[3] ARGV[4] COUNT ARGV[5] STREAMS KEYS[3] ARGV[6]. Returns {reply,
    # '', then}, or {nil, id of the stream's last entry ('0-0': empty)} when nothing came:
    # where the caller's blocking XREAD waits from. With KEYS[4] (a Then), ``then`` is
    # XREAD COUNT ARGV[8] STREAMS KEYS[4] ARGV[7] (nil: nothing after ARGV[7]).
    _READ_LUA = """
local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[3], ARGV[4], 'COUNT', ARGV[5],
                      'STREAMS', KEYS[3], ARGV[6])
if type(r) == 'table' and r.err then return r end
if r then
  if KEYS[4] then
    return {r, '', redis.call('XREAD', 'COUNT', ARGV[8], 'STREAMS', KEYS[4], ARGV[7])}
  end
  return {r, ''}
end
local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
if #last == 0 then return {false, '0-0'} end
return {false, last[1][1]}
"""

    async def _fenced_read(self, count: int, block_ms: int | None, start: bytes | str,
                           then: Then | None) -> tuple[Reply, Reply]:
        """XREADGROUP behind the fence, never blocking; when nothing is new, a plain XREAD
        BLOCK (no side effect: a fenced-out member may run it) waits for an entry after the
        stream's last one, then the fenced read runs once more. Wraps EVAL (XREADGROUP,
        XREVRANGE, and ``then``'s XREAD), XREAD."""
        args: list[Arg] = [self.group, self.name, count, start]
        keys: list[str] = []
        if then is not None:
            keys, args = [then.stream], [*args, then.after, then.limit]
        reply, last, *after = await self._script(self._READ_LUA, keys, args, op="XREADGROUP",
                                                 on_retry=self._lost_reply)
        if reply or not block_ms or block_ms <= 0 or start != ">":
            return reply, after[0] if after else None
        woke = await self._run(self.bus.command(
            "XREAD", "COUNT", 1, "BLOCK", int(block_ms), "STREAMS", self.stream, last,
            block_ms=int(block_ms)))
        if not woke:
            return None, None
        reply, _, *after = await self._script(self._READ_LUA, keys, args, op="XREADGROUP",
                                              on_retry=self._lost_reply)
        return reply, after[0] if after else None

    async def _read_new(self, count: int, block_ms: int | None, then: Then | None
                        ) -> tuple[list[Delivery], ThenRead | None]:
        try:
            reply, after = await self._xreadgroup(count, block_ms, ">", then)
        except BusUnavailable:
            self._lost_reply(0, BusError())
            raise
        if not reply:
            return [], None
        stream = self.stream
        accept = self.accept
        inflight = self._inflight
        out: list[Delivery] = []
        bad: list[_Bad] = []
        for entry_id, fields in reply[0][1]:
            eid = entry_id.decode()
            # Inlined split_fields fast path: this loop is the consumer's hot path.
            if fields is not None and len(fields) == 2 and fields[0] == FIELD:
                raw = fields[1]
            else:
                raw = split_fields(fields)
            try:
                msg = decode(raw)
            except DecodeError as exc:
                bad.append(_Bad(eid, exc.reason, raw_of(fields), 1, refusal_kind(exc.reason)))
                continue
            if accept is not None and not isinstance(msg, accept):
                bad.append(_Bad(eid, _unexpected(msg, stream), raw_of(fields), 1,
                                UNEXPECTED_KIND))
                continue
            inflight.add(eid)
            out.append(Delivery(eid, msg, 1, stream))
        if bad:
            await self._dead_letter_many(bad)
        self.stats.delivered += len(out)
        return out, None if then is None or self.fence is None else _then_read(then, after)

    async def _read_backlog(self, count: int) -> list[Delivery]:
        while True:
            reply, _ = await self._xreadgroup(count, None, self._cursor)
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
        rows = await self._run(
            self.bus.pipeline([("XPENDING", self.stream, self.group, i, i, 1) for i in ids])
        )
        counts: dict[str, int] = {}
        for row in rows:
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
        bad: list[_Bad] = []
        trimmed = 0
        for eid, fields in entries:
            # An id missing from XPENDING was acked meanwhile by someone else: skip it.
            n = counts.get(eid)
            if n is None:
                continue
            if fields is None:
                bad.append(_Bad(eid, TRIMMED_REASON, b"", n, TRIMMED_REASON))
                trimmed += 1
                continue
            if n > self.max_deliveries:
                bad.append(_Bad(eid, f"{EXCEEDED_REASON} ({n} > {self.max_deliveries})",
                                raw_of(fields), n, EXCEEDED_REASON))
                continue
            try:
                msg = decode(split_fields(fields))
            except DecodeError as exc:
                bad.append(_Bad(eid, exc.reason, raw_of(fields), n, refusal_kind(exc.reason)))
                continue
            if self.accept is not None and not isinstance(msg, self.accept):
                bad.append(_Bad(eid, _unexpected(msg, self.stream), raw_of(fields), n,
                                UNEXPECTED_KIND))
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
        n = await self._call("XACK", self.stream, self.group, *keys)
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

    # XACK KEYS[3] ARGV[3] ARGV[n+6..], then XADD KEYS[4] * ARGV[4] ARGV[5+i] for i = 1..n
    # (n = ARGV[5]), atomically as MULTI/EXEC would. Returns {new ids, how many were pending}.
    _ADD_AND_ACK_LUA = """
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

    async def _add_and_ack(
        self, op: str, stream: str, payloads: Sequence[bytes], ids: Sequence[str]
    ) -> tuple[list[str], int]:
        """MULTI; XADD stream (one entry per payload); XACK this group's ``ids``; EXEC
        (with a fence: one fenced script, the XACK first). Returns the new entry ids and how
        many of ``ids`` were pending."""
        if self.fence is not None:
            added, acked = await self._script(
                self._ADD_AND_ACK_LUA, [stream],
                [self.group, FIELD, len(payloads), *payloads, *ids], op=op)
            self._inflight.difference_update(ids)
            return [a.decode() for a in added], int(acked)
        commands: list[Sequence[Arg]] = [xadd_args(stream, data) for data in payloads]
        if ids:
            commands.append(("XACK", self.stream, self.group, *ids))
        replies = await self._run(self.bus.pipeline(commands, atomic=True, op=op))
        self._inflight.difference_update(ids)
        return ([r.decode() for r in replies[: len(payloads)]],
                int(replies[-1]) if ids else 0)

    def acked(self, ids: Iterable[str]) -> None:
        """Record that ``ids`` were acked by another call than :meth:`ack` (e.g. inside a
        fenced script together with the event that justifies the ack)."""
        keys = list(ids)
        self._inflight.difference_update(keys)
        self.stats.acked += len(keys)

    async def dead_letter(self, entry: str | Delivery, reason: str, raw: bytes = b"") -> None:
        """Give up on an entry: write a DeadLetter with ``reason`` and XACK it, atomically.
        For handlers that find a message invalid. ``raw`` defaults to the re-encoded message
        of a Delivery. :meth:`dead_letter_many` for several at once."""
        await self.dead_letter_many([Refusal(entry, reason, raw=raw)])

    async def dead_letter_many(self, refusals: Sequence[Refusal]) -> int:
        """Give up on several entries in one round trip: a DeadLetter for each and their
        XACK in one script (see :meth:`_dead_letter_many`). Returns how many older dead
        letters the DLQ's cap dropped."""
        bad = []
        for r in refusals:
            if isinstance(r.entry, Delivery):
                eid, n, raw = r.entry.id, r.entry.deliveries, r.raw or encode(r.entry.msg)
            else:
                eid, n, raw = r.entry, 1, r.raw
            bad.append(_Bad(eid, r.reason, raw, n, refusal_kind(r.reason, r.kind)))
        return await self._dead_letter_many(bad)

    # XACK KEYS[3] ARGV[3] (ids ARGV[n+7..], a thousand at a time: Lua's unpack has a stack
    # limit), then XADD KEYS[4] * ARGV[4] ARGV[6+i] for i = 1..n (n = ARGV[6]), then XTRIM
    # KEYS[4] MAXLEN ~ ARGV[5] and INCRBY KEYS[5] by what it trimmed. Returns {how many were
    # pending, how many dead letters were dropped}.
    _DEAD_LETTER_LUA = """
local n = tonumber(ARGV[6])
local acked = 0
local first = n + 7
while first <= #ARGV do
  local last = math.min(first + 999, #ARGV)
  local r = redis.pcall('XACK', KEYS[3], ARGV[3], unpack(ARGV, first, last))
  if type(r) == 'table' and r.err then return r end
  acked = acked + r
  first = last + 1
end
for i = 1, n do redis.call('XADD', KEYS[4], '*', ARGV[4], ARGV[6 + i]) end
local dropped = redis.call('XTRIM', KEYS[4], 'MAXLEN', '~', ARGV[5])
if dropped > 0 then redis.call('INCRBY', KEYS[5], dropped) end
return {acked, dropped}
"""

    async def _dead_letter_many(self, items: Sequence[_Bad]) -> int:
        """One script for the batch, behind the fence if we have one: XACK the ids, XADD a
        DeadLetter for each to the DLQ, XTRIM it to its cap and count what that dropped.
        The refusals are tallied and said once per interval (never one line per entry: a
        flood would fill the log). Returns how many dead letters were dropped."""
        letters = [
            encode(DeadLetter(source_stream=self.stream, entry_id=b.id, reason=b.reason,
                              raw=b.raw, deliveries=b.deliveries, group=self.group,
                              consumer=self.name))
            for b in items
        ]
        ids = [b.id for b in items]
        _, dropped = await self._script(
            self._DEAD_LETTER_LUA, [self.dlq_stream, dlq_dropped_key(self.dlq_stream)],
            [self.group, FIELD, self.dlq_max, len(letters), *letters, *ids], op="DLQ")
        self._inflight.difference_update(ids)
        self.stats.dead_lettered += len(items)
        self.tally.add([(b.id, b.reason, b.kind) for b in items], int(dropped))
        self._say_refusals()
        return int(dropped)

    def _say_refusals(self) -> None:
        """The line about refused entries, when one is due (RefusalTally)."""
        line = self.tally.line(time.monotonic())
        if line is not None:
            log.warning("%s", line)

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
                "XAUTOCLAIM", self.stream, self.group, self.name, idle, start, "COUNT", count
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
        for owner in owners:
            if owner == self.name:
                continue
            while True:
                rows = await self._run(self.bus.command(
                    "XPENDING", self.stream, self.group, "-", "+", count, owner
                ))
                ids = [row[0] for row in rows or []]
                if not ids:
                    break
                claimed = await self._call("XCLAIM", self.stream, self.group, self.name, 0, *ids)
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

    # Member ARGV[5] of group ARGV[3] on KEYS[3]: XCLAIM (JUSTID: its delivery counter is
    # kept, our next read of our own pending entries counts one more) up to ARGV[6] of its
    # pending entries for ARGV[4]; once it owns none, XGROUP DELCONSUMER it. Returns {ids it
    # held, ids claimed} ({{}, {}}: removed). Redis 7 drops an entry deleted while pending
    # from the PEL instead of claiming it (6.2 claims it: our read finds it trimmed).
    _ADOPT_LUA = """
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

    async def adopt(self, count: int = 1000) -> dict[str, int]:
        """Take over every entry pending on the group's other members and remove them, for
        a group with one member at a time whose earlier incarnations read under other names
        (the trainer, ``trainer-<epoch>``; a fence keeps them from reading again). Returns
        ``{member: entries taken}``, one key per member removed.

        The entries keep their delivery counters and come back from :meth:`read` (own
        pending entries first), each counted once more there. An entry deleted while
        pending is dead-lettered (:data:`TRIMMED_REASON`). Wraps XINFO CONSUMERS, then one
        EVAL per ``count`` entries of each member (XPENDING, XCLAIM JUSTID; XGROUP
        DELCONSUMER once it owns none)."""
        taken: dict[str, int] = {}
        for member in await member_names(self.bus, self.stream, self.group):
            if member == self.name:
                continue
            taken[member] = 0
            last: list[bytes] = []
            while True:
                held, claimed = await self._script(
                    self._ADOPT_LUA, [], [self.group, self.name, member, count], op="XCLAIM")
                if not held or held == last:  # removed (or, defensively, no progress)
                    break
                last = held
                gone = sorted(set(held) - set(claimed), key=entry_key)
                if gone:  # Redis 7: dropped from the PEL, never claimed
                    self.stats.trimmed += len(gone)
                    await self._dead_letter_many(
                        [_Bad(g.decode(), TRIMMED_REASON, b"", 1, TRIMMED_REASON) for g in gone])
                taken[member] += len(claimed)
        if any(taken.values()):
            self._lost_reply(0, BusError())  # read our own pending entries (now theirs) first
        self.stats.reclaimed += sum(taken.values())
        return taken

    async def _find_deleted(self, start: bytes, next_cursor: bytes, live: set[str]) -> list[str]:
        """Ids in our PEL within [start, next_cursor) whose entries no longer exist.
        Wraps XPENDING (range, this consumer) and XRANGE id id (existence)."""
        end: bytes = b"+" if next_cursor == b"0-0" else b"(" + next_cursor
        lo: bytes = start
        candidates: list[str] = []
        while True:
            rows = await self._run(self.bus.command(
                "XPENDING", self.stream, self.group, lo, end, 1000, self.name
            ))
            candidates += [r[0].decode() for r in rows if r[0].decode() not in live]
            if len(rows) < 1000:
                break
            lo = b"(" + rows[-1][0]
        found = await self._run(
            self.bus.pipeline([("XRANGE", self.stream, c, c) for c in candidates])
        )
        return [c for c, rows in zip(candidates, found, strict=True) if not rows]


def _then_read(then: Then, reply: Reply) -> ThenRead:
    """A :class:`Then`'s XREAD reply (nil: nothing after ``then.after``), decoded."""
    if not reply:
        return ThenRead([], then.after, False)
    raw = reply[0][1]
    entries = [e for entry_id, fields in raw
               if (e := decode_fields(then.stream, entry_id, fields, None)) is not None]
    return ThenRead(entries, raw[-1][0].decode(), len(raw) >= then.limit)


def _unexpected(msg: Message, stream: str) -> str:
    return f"unexpected message type {type(msg).__name__} on {stream}"
