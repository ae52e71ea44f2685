"""A run's events log as one sequence: the archive on disk, then the stream in Redis.

With ``run.retention=checkpoint`` the trainer moves the oldest events from the stream to the
archive (:mod:`storage.archive`) after each durable checkpoint: :func:`archive_below` appends
them (fsynced) and only then trims them (XTRIM MINID). Every reader that reads from the
beginning, or from a position that may have been trimmed since, uses :func:`read_history`,
which yields archived entries, then the stream's, each exactly once and in order.

Functions (coroutines unless noted)
    ``events_folder(output_dir, run_id) -> Path``   the archive's folder (plain function)
    ``read_history(bus, stream, folder, start="0", *, count=500, on_bad=None,
    on_gap=None)``  async iterator of :class:`~bus.streams.Entry` after ``start``
    ``archive_below(bus, stream, folder, below, *, readers=(), fence=None,
    location_key=None) -> Archived``
    ``find_archive(bus, keys, configured) -> Path | None``  the archive a reader can open

How the two halves join: each read of the stream asks, in the same MULTI/EXEC, for the
stream's first entry (:meth:`bus.Bus.read_page`). Whatever lies between the reader's cursor
and that first entry is not in Redis any more, so it is read from the archive (archived
before it was trimmed, so it is there). A trim between two reads is noticed the same way.
When the archive holds nothing there (another machine's disk, or it was deleted) and the
cursor itself is gone, ``on_gap(cursor, first)`` says which range was skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import NamedTuple

from bus import BadEntry, Bus, Entry, RunKeys, entry_key
from storage.archive import ArchivedEntry, append, read_archive, truncate_from

__all__ = ["Archived", "archive_below", "events_folder", "find_archive", "read_history"]

_FROM_START = ("0", "0-0", "-")


def events_folder(output_dir: str | Path, run_id: str) -> Path:
    """Where run ``run_id``'s archived events live: ``output_dir/RUN/events``."""
    return Path(output_dir) / run_id / "events"


class Archived(NamedTuple):
    """What one :func:`archive_below` did: entries appended to the archive, entries trimmed
    from the stream, and the id everything before which is now only in the archive (None
    when nothing was trimmed)."""

    archived: int
    trimmed: int
    cut: str | None


async def find_archive(bus: Bus, keys: RunKeys, configured: Path | None) -> Path | None:
    """The run's archive folder this process can read: ``configured`` (its own
    ``run.output_dir``) when it exists, else the path the trainer recorded in
    :attr:`~bus.keys.RunKeys.archive` when that exists here (same machine, another working
    folder), else ``configured`` (reads then find nothing there: the stream only)."""
    if configured is not None and await asyncio.to_thread(configured.is_dir):
        return configured
    recorded = await bus.get_text(keys.archive)
    if recorded:
        path = Path(recorded)
        if await asyncio.to_thread(path.is_dir):
            return path
    return configured


def _take(it: Iterator[ArchivedEntry], n: int) -> list[ArchivedEntry]:
    return list(islice(it, n))


async def _read_trimmed(
    bus: Bus,
    stream: str,
    folder: Path | None,
    cursor: str,
    first: str,
    *,
    count: int,
    on_bad: Callable[[BadEntry], None] | None,
    on_gap: Callable[[str, str], None] | None,
) -> AsyncGenerator[Entry, None]:
    """The entries after ``cursor`` and before ``first`` (the stream's first entry), which
    were trimmed from the stream: from the archive in ``folder``. When it holds none of them
    and the cursor was not the start, ``on_gap(cursor, first)`` says what was skipped."""
    from_start = cursor in _FROM_START
    found = False
    if folder is not None:
        it = read_archive(folder, after=None if from_start else cursor, before=first)
        while chunk := await asyncio.to_thread(_take, it, count):
            found = True
            for archived in chunk:
                entry = bus.decode_entry(stream, archived.id, archived.fields, on_bad)
                if entry is not None:
                    yield entry
    if not found and not from_start and on_gap is not None:
        on_gap(cursor, first)


async def read_history(
    bus: Bus,
    stream: str,
    folder: Path | None,
    start: str = "0",
    *,
    count: int = 500,
    on_bad: Callable[[BadEntry], None] | None = None,
    on_gap: Callable[[str, str], None] | None = None,
) -> AsyncGenerator[Entry, None]:
    """Every entry after ``start`` (``"0"``: from the beginning), archive then stream, in
    order and each once. ``folder``: the archive (None: the stream only). Bad entries are
    skipped as :meth:`bus.Bus.read_all` skips them. File reads run on a worker thread."""
    cursor = start
    while True:
        first, page = await bus.read_page(stream, cursor, count=count)
        if first is not None and (cursor in _FROM_START or entry_key(first) > entry_key(cursor)):
            # Entries between the cursor and the stream's first one were trimmed: archived.
            trimmed = _read_trimmed(bus, stream, folder, cursor, first, count=count,
                                    on_bad=on_bad, on_gap=on_gap)
            async with contextlib.aclosing(trimmed):  # closed here even if our reader stops
                async for entry in trimmed:
                    yield entry
        for entry_id, fields in page:
            decoded = bus.decode_entry(stream, entry_id, fields, on_bad)
            if decoded is not None:
                yield decoded
        if page:
            cursor = page[-1][0]
        if len(page) < count:
            return


async def archive_below(
    bus: Bus,
    stream: str,
    folder: Path,
    below: str,
    *,
    readers: Sequence[tuple[str, str]] = (),
    fence: tuple[str, str] | None = None,
    count: int = 1000,
    location_key: str | None = None,
    before_trim: Callable[[], Awaitable[None]] | None = None,
) -> Archived:
    """Move the entries before ``below`` (never past a live reader's stored position, see
    :meth:`bus.Bus.trim_log`) from ``stream`` to the archive in ``folder``: append them
    (fsynced, on a worker thread), then trim them (XTRIM MINID). A crash in between leaves
    them in both; the next call rewrites them from the stream, never twice. With
    ``location_key`` the folder's absolute path is stored there first (SET), for readers that
    do not know it (:func:`find_archive`). ``before_trim``: awaited once the archive holds
    the entries and before they are trimmed (a copy of the archive elsewhere, kept as
    complete as the trim assumes)."""
    floor = await bus.reader_floor(readers)
    cut = below if floor is None or entry_key(below) <= entry_key(floor) else floor
    first, page = await bus.read_page(stream, "0", f"({cut}", count=count)
    if first is None or entry_key(first) >= entry_key(cut):
        return Archived(0, 0, None)
    # The stream is the truth for everything it still holds: archived copies of those
    # (a crash before the last trim, a Redis that lost its tail) are rewritten from it.
    if location_key is not None:
        await bus.set_text(location_key, str(await asyncio.to_thread(folder.resolve)))
    await asyncio.to_thread(truncate_from, folder, first)
    archived = 0
    while page:
        archived += await asyncio.to_thread(append, folder, page)
        if len(page) < count:
            break
        _, page = await bus.read_page(stream, page[-1][0], f"({cut}", count=count)
    if before_trim is not None:
        await before_trim()
    trimmed = await bus.trim_log(stream, cut, readers=readers, fence=fence)
    return Archived(archived, trimmed, cut if trimmed else None)
