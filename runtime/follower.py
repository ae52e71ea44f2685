"""A follower of a run's events log, in the spirit of eventsourcing's followers.

One :class:`Follower` per process reads the log in order, each entry once, from a tracking
position: the archive first when the position lies before what the stream still holds
(:func:`runtime.history.read_history`), then the stream, then new entries as they arrive. Each
new entry is handed to the follower's ``fold`` (the reader's pure state function) before a
read returns, so a state folded from the log never misses or repeats an entry, however many
tasks of the process read.

Reads may overlap (a task blocks on the stream while another needs what is there now, e.g.
the rollouter's step watcher and its ticket loop): each read starts from the position it
finds, and what another read already folded is dropped by entry id. A read that starts after
a call began sees everything written before that call: that is what "read the events after
these tickets" needs, with one cursor instead of one per task.

The position is the follower's output's business: a component stores it with what it writes
(the profiler service's snapshot, the metrics logger's position file, a checkpoint's state),
or in Redis at every pulse (:class:`runtime.Component`) so the trainer's events trim keeps
what it has not read while it lives.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from bus import LOG_ROLES, BadEntry, Bus, Entry, RunKeys, entry_key, log_order
from runschema.authority import refusal
from runtime.history import read_history

__all__ = ["Follower", "LogFollower", "since"]

log = logging.getLogger(__name__)

Fold = Callable[[Sequence[Entry]], None]


def _after(entry_id: str, position: str) -> bool:
    return entry_key(entry_id) > entry_key(position)


def since(entry_id: str | None) -> str:
    """A position in another stream of the log that reads what was written from
    ``entry_id``'s millisecond on (entry ids of different streams compare by Redis's clock;
    within one millisecond their order is unknown, so that millisecond is read too)."""
    if entry_id is None or entry_id in ("0", "0-0"):
        return "0"
    ms = int(entry_id.partition("-")[0])
    return f"{ms - 1}-{2**64 - 1}" if ms > 0 else "0"


Item = TypeVar("Item")
"""What a follower reads one at a time: an entry, or (stream, entry) from several streams."""


class _Reader(Generic[Item]):
    """What both followers share: reading in batches of :attr:`count`, each folded by
    ``_take``, and catching up through :meth:`history`."""

    count: int
    caught_up: bool

    def _take(self, items: Sequence[Item]) -> list[Entry]:
        raise NotImplementedError

    def history(self, on_gap: Callable[[str, str], None] | None = None,
                ) -> AsyncIterator[list[Entry]]:
        raise NotImplementedError

    async def _in_batches(self, items: AsyncIterator[Item]) -> AsyncIterator[list[Entry]]:
        """``items`` to the end, folded ``count`` at a time; then caught up."""
        batch: list[Item] = []
        async for item in items:
            batch.append(item)
            if len(batch) >= self.count:
                yield self._take(batch)
                batch = []
        if batch:
            yield self._take(batch)
        self.caught_up = True

    async def catch_up(self, on_gap: Callable[[str, str], None] | None = None) -> int:
        """Fold everything after the position(s) (:meth:`history`); how many entries."""
        read = 0
        async for batch in self.history(on_gap):
            read += len(batch)
        return read


class Follower(_Reader[Entry]):
    """Reads ``stream`` after ``position`` (``"0"``: from the beginning); ``fold`` gets every
    new entry once, in log order. ``archive``: the folder of the run's archived events
    (:func:`runtime.history.events_folder`), read when the stream was trimmed past the position."""

    def __init__(self, bus: Bus, stream: str, position: str = "0", *, fold: Fold | None = None,
                 archive: Path | None = None, count: int = 1000,
                 on_bad: Callable[[BadEntry], None] | None = None) -> None:
        self.bus = bus
        self.stream = stream
        self.position = position
        """Id of the last entry read (or passed over as garbage); ``"0"`` before any."""
        self.fold = fold
        self.archive = archive
        self.count = count
        self.on_bad = on_bad
        """Told of every entry passed over as garbage (logged by the bus either way)."""
        self.caught_up = False
        """The last read reached the end of the stream."""

    def _take(self, entries: Sequence[Entry], cursor: str | None = None) -> list[Entry]:
        """The entries after the position, folded; the position moves past them (and past
        ``cursor``, where a read passed over garbage). No await: one step of the loop."""
        new = [e for e in entries if _after(e.id, self.position)]
        if new:
            self.position = new[-1].id
        if cursor is not None and _after(cursor, self.position):
            self.position = cursor
        if new and self.fold is not None:
            self.fold(new)
        return new

    async def history(self, on_gap: Callable[[str, str], None] | None = None,
                      ) -> AsyncIterator[list[Entry]]:
        """Everything after the position up to the end of the log, in batches: the archive
        first where the stream was trimmed past the position, then the stream. ``on_gap``
        hears of a trimmed range the archive here does not hold."""
        entries = read_history(self.bus, self.stream, self.archive, self.position,
                               count=self.count, on_bad=self.on_bad, on_gap=on_gap)
        async for batch in self._in_batches(entries):
            yield batch

    async def poll(self, block_ms: int | None = None) -> list[Entry]:
        """One read of the stream after the position (wraps XREAD; ``block_ms``: wait at most
        that long for something new): the new entries, folded."""
        entries, cursor = await self.bus.read_after(self.stream, self.position,
                                                    count=self.count, block_ms=block_ms,
                                                    on_bad=self.on_bad)
        self.caught_up = len(entries) < self.count
        return self._take(entries, cursor)

    def took(self, entries: Sequence[Entry], cursor: str, full: bool) -> list[Entry]:
        """A read of the stream after the position made elsewhere (in the same script as
        another read: :meth:`bus.Consumer.read_then`), taken as :meth:`poll` takes its own:
        the new entries, folded; ``full``: it returned as many as it could (more may
        follow)."""
        self.caught_up = not full
        return self._take(entries, cursor)


class LogFollower(_Reader[tuple[str, Entry]]):
    """Follows a run's log: the streams of several writing roles (``roles``, each its own
    stream, :meth:`bus.RunKeys.log`), merged by entry id into one sequence; ``fold`` gets
    every new entry once, in that order. Within one millisecond (entry ids of different
    streams can tie on time) the role order of :data:`bus.keys.LOG_ROLES` decides: the
    trainer's facts first.

    Every entry is checked against what its stream's role may state
    (:func:`runschema.authority.refusal`): an entry its role may not state is refused (logged,
    handed to ``on_refused(role, entry, reason)``), never folded; the position moves past it.

    ``positions`` maps a stream to the id after which to start (``"0"`` by default);
    :attr:`position` is where the reader stands in the trainer's stream (what the trainer's
    events trim keeps for it);
    ``archive`` is the trainer's events archive (only :attr:`bus.RunKeys.events` is
    archived and trimmed)."""

    def __init__(self, bus: Bus, keys: RunKeys, roles: Sequence[str] = LOG_ROLES,
                 positions: Mapping[str, str] | None = None, *, fold: Fold | None = None,
                 archive: Path | None = None, count: int = 1000,
                 on_bad: Callable[[BadEntry], None] | None = None,
                 on_refused: Callable[[str, Entry, str], None] | None = None,
                 skip: Callable[[str, Entry], bool] | None = None) -> None:
        self.bus = bus
        self.keys = keys
        self.roles = {keys.log(role): role for role in LOG_ROLES if role in roles}
        self.positions = {s: (positions or {}).get(s, "0") for s in self.roles}
        """Per stream: id of the last entry read (or passed over); ``"0"`` before any."""
        self.fold = fold
        self.archive = archive
        self.count = count
        self.on_bad = on_bad
        self.on_refused = on_refused
        self.skip = skip
        """``skip(stream, entry)``: True for an entry the reader already folded (its own
        publication, folded when written); the position moves past it."""
        self.refused = 0
        """How many entries were refused (:func:`runschema.authority.refusal`)."""
        self.caught_up = False

    @property
    def position(self) -> str:
        """Where this reader stands in the trainer's events stream (what the trainer's
        events trim keeps for it); ``"0"`` when it does not follow that stream."""
        return self.positions.get(self.keys.events, "0")

    @position.setter
    def position(self, entry_id: str) -> None:
        if self.keys.events in self.positions:
            self.positions[self.keys.events] = entry_id

    def newest(self) -> str | None:
        """The newest entry id read from the followed streams other than the trainer's
        (None: none yet): what a trainer's next write must come after (bus.Lease.write)."""
        read = [p for s, p in self.positions.items()
                if s != self.keys.events and p not in ("0", "0-0")]
        return max(read, key=entry_key) if read else None

    def start_at_end(self, positions: Mapping[str, str]) -> None:
        """Start after ``positions`` (e.g. what :meth:`ends` returned): the past is not
        news."""
        self.positions.update({s: p for s, p in positions.items() if s in self.positions})

    async def ends(self) -> dict[str, str]:
        """The id of each followed stream's newest entry now (``"0"`` for an empty one).
        Wraps XREVRANGE COUNT 1 per stream."""
        ends: dict[str, str] = {}
        for stream in self.roles:
            latest = await self.bus.latest_id(stream)
            ends[stream] = latest or "0"
        return ends

    def _admit(self, stream: str, entries: Sequence[Entry]) -> list[Entry]:
        role = self.roles[stream]
        admitted = []
        for entry in entries:
            reason = refusal(role, entry.msg)
            if reason is None:
                admitted.append(entry)
                continue
            self.refused += 1
            log.warning("refusing entry %s of %s: %s", entry.id, stream, reason)
            if self.on_refused is not None:
                self.on_refused(role, entry, reason)
        return admitted

    def _take(self, merged: Sequence[tuple[str, Entry]]) -> list[Entry]:
        """Fold merged ``(stream, entry)`` pairs after the positions; the positions move
        past them. No await: one step of the loop."""
        new: list[Entry] = []
        for stream, entry in merged:
            if not _after(entry.id, self.positions[stream]):
                continue
            self.positions[stream] = entry.id
            if self.skip is None or not self.skip(stream, entry):
                new.extend(self._admit(stream, [entry]))
        if new and self.fold is not None:
            self.fold(new)
        return new

    def _order(self, stream: str, entry: Entry) -> tuple[int, int, int]:
        return log_order(entry.id, self.roles[stream])

    async def history(self, on_gap: Callable[[str, str], None] | None = None,
                      ) -> AsyncIterator[list[Entry]]:
        """Everything after the positions up to the end of each stream, merged, in
        batches (the trainer's archive first where its stream was trimmed)."""
        async for batch in self._in_batches(self._merged(on_gap)):
            yield batch

    async def _merged(self, on_gap: Callable[[str, str], None] | None,
                      ) -> AsyncIterator[tuple[str, Entry]]:
        """``(stream, entry)`` after the positions, every stream to its end, in log order
        (a merge of the streams' histories by :meth:`_order`)."""
        async with contextlib.AsyncExitStack() as stack:
            heads: dict[str, tuple[AsyncGenerator[Entry, None], Entry]] = {}
            for stream in self.roles:
                it = read_history(self.bus, stream,
                                  self.archive if stream == self.keys.events else None,
                                  self.positions[stream], count=self.count,
                                  on_bad=self.on_bad, on_gap=on_gap)
                await stack.enter_async_context(contextlib.aclosing(it))
                first = await anext(it, None)
                if first is not None:
                    heads[stream] = (it, first)
            while heads:
                stream = min(heads, key=lambda s: self._order(s, heads[s][1]))
                it, entry = heads[stream]
                yield stream, entry
                following = await anext(it, None)
                if following is None:
                    del heads[stream]
                else:
                    heads[stream] = (it, following)

    async def poll(self, block_ms: int | None = None) -> list[Entry]:
        """One read of every stream after its position (wraps XREAD over them all;
        ``block_ms``: wait at most that long for something new): the new entries, merged
        and folded. A stream that filled the read's ``count`` may have more before what
        another stream returned: entries after the earliest such cut wait for the next
        read, so the merged order never goes back."""
        read = await self.bus.read_after_many(dict(self.positions), count=self.count,
                                              block_ms=block_ms, on_bad=self.on_bad)
        full = [log_order(cursor, self.roles[s]) for s, (_, cursor, is_full) in read.items()
                if is_full]
        cut = min(full) if full else None
        self.caught_up = cut is None
        merged: list[tuple[str, Entry]] = []
        passed: dict[str, str] = {}
        for stream, (entries, cursor, _) in read.items():
            role = self.roles[stream]
            merged.extend((stream, e) for e in entries
                          if cut is None or log_order(e.id, role) <= cut)
            if cut is None or log_order(cursor, role) <= cut:
                passed[stream] = cursor  # garbage passed over: never read twice
        merged.sort(key=lambda pair: self._order(*pair))
        new = self._take(merged)
        for stream, cursor in passed.items():
            if _after(cursor, self.positions[stream]):
                self.positions[stream] = cursor
        return new
