"""Reading streams as logs: every reader keeps its own cursor, no consumer group.

Two reads: a range (:meth:`LogCommands.read_all`, for small streams read whole) and one read
after a cursor (:meth:`LogCommands.read_after`, the primitive of every poll loop). Following
a run's events log (archive then stream, each entry once, from a tracking position) is
:class:`runtime.Follower`, built on these and on :func:`runtime.history.read_history`.

Decisions:

- **Bad entries** (undecodable bytes, unknown type, newer schema version) are skipped
  (logged at WARNING) and, when given, passed to ``on_bad(BadEntry)``; they are never
  dead-lettered here, because a log has many readers and each would write its own copy.
  Log readers never crash on garbage.
- A missing stream reads as an empty one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from bus.client import BusClient, block_args
from bus.entries import BadEntry, Entry, decode_fields
from runschema.messages import Message

__all__ = ["LogCommands"]

_MAX_ID = b"+"
_FROM_START = ("0", "0-0", "-")

OnBad = Callable[[BadEntry], None]


class LogCommands(BusClient):
    """XRANGE / XREVRANGE / XREAD / XLEN on a stream read as a log."""

    async def read_all(
        self,
        stream: str,
        start: str = "0",
        end: str = "+",
        *,
        count: int = 500,
        on_bad: OnBad | None = None,
    ) -> AsyncIterator[Entry]:
        """Every entry from ``start`` (inclusive) to ``end``, in order. Wraps XRANGE paging.

        Bad entries are skipped (see the module docstring). A missing stream yields nothing.
        """
        cursor: str | bytes = "-" if start in _FROM_START else start
        while True:
            page = await self.command("XRANGE", stream, cursor, end, "COUNT", count)
            for entry_id, fields in page:
                entry = decode_fields(stream, entry_id, fields, on_bad)
                if entry is not None:
                    yield entry
            if len(page) < count:
                return
            cursor = b"(" + page[-1][0]

    async def read_after(
        self,
        stream: str,
        last_id: str,
        *,
        count: int = 100,
        block_ms: int | None = None,
        on_bad: OnBad | None = None,
    ) -> tuple[list[Entry], str]:
        """One read of the entries after ``last_id``: ``(entries, cursor)``. Wraps XREAD.

        For poll loops: ``block_ms=None`` (or 0) returns at once, else waits at most that
        long. ``cursor`` is the id to pass next time; it moves past skipped bad entries too,
        so a garbage entry is never read twice. A missing stream gives ``([], last_id)``.
        """
        reply = await self.command(
            "XREAD", "COUNT", count, *block_args(block_ms), "STREAMS", stream, last_id,
            block_ms=block_ms,
        )
        if not reply:
            return [], last_id
        raw_entries = reply[0][1]
        entries = [
            entry
            for entry_id, fields in raw_entries
            if (entry := decode_fields(stream, entry_id, fields, on_bad)) is not None
        ]
        return entries, raw_entries[-1][0].decode()

    async def read_after_many(
        self,
        positions: dict[str, str],
        *,
        count: int = 100,
        block_ms: int | None = None,
        on_bad: OnBad | None = None,
    ) -> dict[str, tuple[list[Entry], str, bool]]:
        """One read of several streams after their positions: for each stream that had
        something, ``(entries, cursor, full)``, ``full`` when it returned ``count`` entries
        (more may follow). Wraps XREAD over several streams (``block_ms`` as in
        :meth:`read_after`: waits until any of them has something)."""
        streams = list(positions)
        reply = await self.command(
            "XREAD", "COUNT", count, *block_args(block_ms), "STREAMS", *streams,
            *(positions[s] for s in streams), block_ms=block_ms,
        )
        read: dict[str, tuple[list[Entry], str, bool]] = {}
        for raw_stream, raw_entries in reply or ():
            stream = raw_stream.decode() if isinstance(raw_stream, bytes) else str(raw_stream)
            if not raw_entries:
                continue
            entries = [
                entry
                for entry_id, fields in raw_entries
                if (entry := decode_fields(stream, entry_id, fields, on_bad)) is not None
            ]
            read[stream] = (entries, raw_entries[-1][0].decode(), len(raw_entries) >= count)
        return read

    async def _latest_id(self, stream: str) -> bytes | None:
        reply = await self.command("XREVRANGE", stream, "+", "-", "COUNT", 1)
        return reply[0][0] if reply else None

    async def latest_id(self, stream: str) -> str | None:
        """The id of the newest entry (decodable or not); None for an empty/missing stream.
        Wraps XREVRANGE COUNT 1."""
        raw = await self._latest_id(stream)
        return None if raw is None else raw.decode()

    async def latest(self, stream: str) -> Entry | None:
        """The newest decodable entry, or None for an empty/missing stream.
        Wraps XREVRANGE COUNT 1 (walking back past undecodable entries)."""
        cursor: bytes = _MAX_ID
        while True:
            reply = await self.command("XREVRANGE", stream, cursor, "-", "COUNT", 16)
            for entry_id, fields in reply:
                entry = decode_fields(stream, entry_id, fields, None)
                if entry is not None:
                    return entry
            if len(reply) < 16:
                return None
            cursor = b"(" + reply[-1][0]

    async def read_ids(self, stream: str, ids: Sequence[str]) -> dict[str, Message]:
        """The entries with exactly these ids that still exist and decode: ``{id: msg}``.
        Wraps pipelined ``XRANGE stream id id`` (O(log n) each, however long the stream)."""
        found: dict[str, Message] = {}
        pages = await self.pipeline([("XRANGE", stream, i, i) for i in ids])
        for page in pages:
            for entry_id, fields in page:
                entry = decode_fields(stream, entry_id, fields, None)
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
        start = "-" if after in _FROM_START else f"({after}"
        head, page = await self.pipeline(
            [("XRANGE", stream, "-", "+", "COUNT", 1),
             ("XRANGE", stream, start, end, "COUNT", count)],
            atomic=True,
        )
        first = head[0][0].decode() if head else None
        return first, [(entry_id.decode(), list(fields or [])) for entry_id, fields in page]

    def decode_entry(
        self, stream: str, entry_id: str, fields: list[bytes],
        on_bad: OnBad | None = None,
    ) -> Entry | None:
        """A raw entry (from :meth:`read_page` or the archive) decoded as :meth:`read_all`
        decodes it: None for a bad one (logged, passed to ``on_bad``). Plain function."""
        return decode_fields(stream, entry_id.encode(), fields, on_bad)

    async def length(self, stream: str) -> int:
        """Number of entries. Wraps XLEN."""
        return int(await self.command("XLEN", stream))
