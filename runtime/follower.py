"""A follower of a run's events log, in the spirit of eventsourcing's followers.

One :class:`Follower` per process reads the log in order, each entry once, from a tracking
position: the archive first when the position lies before what the stream still holds
(:func:`bus.history.read_history`), then the stream, then new entries as they arrive. Each
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

from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from bus import BadEntry, Bus, Entry, entry_key
from bus.history import read_history

__all__ = ["Follower"]

Fold = Callable[[Sequence[Entry]], None]


def _after(entry_id: str, position: str) -> bool:
    return entry_key(entry_id) > entry_key(position)


class Follower:
    """Reads ``stream`` after ``position`` (``"0"``: from the beginning); ``fold`` gets every
    new entry once, in log order. ``archive``: the folder of the run's archived events
    (:func:`bus.history.events_folder`), read when the stream was trimmed past the position."""

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
        batch: list[Entry] = []
        async for entry in read_history(self.bus, self.stream, self.archive, self.position,
                                        count=self.count, on_bad=self.on_bad,
                                        on_gap=on_gap):
            batch.append(entry)
            if len(batch) >= self.count:
                yield self._take(batch)
                batch = []
        if batch:
            yield self._take(batch)
        self.caught_up = True

    async def catch_up(self, on_gap: Callable[[str, str], None] | None = None) -> int:
        """Fold everything after the position (:meth:`history`); how many entries."""
        read = 0
        async for batch in self.history(on_gap):
            read += len(batch)
        return read

    async def poll(self, block_ms: int | None = None) -> list[Entry]:
        """One read of the stream after the position (wraps XREAD; ``block_ms``: wait at most
        that long for something new): the new entries, folded."""
        entries, cursor = await self.bus.read_after(self.stream, self.position,
                                                    count=self.count, block_ms=block_ms,
                                                    on_bad=self.on_bad)
        self.caught_up = len(entries) < self.count
        return self._take(entries, cursor)
