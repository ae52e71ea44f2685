"""The events archive: entries trimmed from a run's events stream, kept on disk in log order.

Pure file code (no Redis): :mod:`runtime.history` moves entries here from the stream and reads
both back as one log. With ``run.retention=checkpoint`` the trainer appends the entries
below its safe point here (fsynced) before it trims them from Redis.

Layout: a folder (``run.output_dir/RUN/events/``) of segment files
``archive-000001.rlev``, ``archive-000002.rlev``, ... in log order. A segment starts with
:data:`MAGIC` and holds records; a new segment starts once one reaches
:data:`SEGMENT_BYTES`. A record is a header ``<II`` (payload length, CRC-32 of the payload)
and the payload: msgpack ``[entry id, [field, value, ...]]``, the entry exactly as XRANGE
returned it (raw bytes: a reader decodes it as it would decode the stream).

Crash safety:

- A torn or corrupt record ends its segment for readers (nothing after it is trusted); the
  next append cuts the segment back to its last whole record first.
- :func:`append` writes only entries newer than the newest archived one, so archiving an
  already archived range again adds nothing.
- :func:`truncate_from` drops every record at or after an id: the archiver calls it with the
  stream's first entry (the stream is the truth for everything it still holds), so records
  a crash left between the archive write and the trim, or that a Redis which lost its tail
  no longer has, are rewritten from the stream, never duplicated.

Writers take an exclusive ``flock`` on ``.lock`` in the folder; readers take no lock (they
stop at a record being written, as at a torn one).

Functions (all blocking: call them from a worker thread)
    ``append(folder, entries) -> int``        records written (entries ``(id, fields)``)
    ``truncate_from(folder, entry_id) -> int`` records removed
    ``read_archive(folder, after=None, before=None) -> Iterator[ArchivedEntry]``
    ``last_archived(folder) -> str | None``   id of the newest whole record
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import struct
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, NamedTuple

import msgspec

from storage.files import atomic_write, fsync_path, numbered_files

__all__ = [
    "MAGIC",
    "SEGMENT_BYTES",
    "ArchivedEntry",
    "append",
    "fsync_path",  # moved to storage.files; still importable from here
    "last_archived",
    "read_archive",
    "segments",
    "truncate_from",
]

MAGIC = b"RLBUSEV1"
"""First bytes of every segment file."""

SEGMENT_BYTES = 16 * 1024 * 1024
"""A segment at or past this size is closed; the next append starts a new one."""

_HEADER = struct.Struct("<II")
_NAME = re.compile(r"^archive-(\d{6,})\.rlev$")
_ENCODE = msgspec.msgpack.Encoder()
_DECODE = msgspec.msgpack.Decoder(tuple[str, list[bytes]])


class ArchivedEntry(NamedTuple):
    """One archived stream entry: its id and its raw fields (``[name, value, ...]``)."""

    id: str
    fields: list[bytes]


def _key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _number(name: str) -> int:
    """A segment's number, from its file name (``archive-000007.rlev``: 7)."""
    match = _NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not the name of an archive segment")
    return int(match[1])


def segments(folder: Path) -> list[Path]:
    """The segment files of ``folder`` in log order ([] when it does not exist)."""
    return numbered_files(folder, _NAME)


def _records(fh: BinaryIO) -> Iterator[tuple[int, int, ArchivedEntry]]:
    """``(start offset, end offset, entry)`` of each whole record after the magic; stops at
    the first torn or corrupt one."""
    offset = len(MAGIC)
    fh.seek(offset)
    while True:
        header = fh.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        length, crc = _HEADER.unpack(header)
        payload = fh.read(length)
        if len(payload) < length or zlib.crc32(payload) != crc:
            return
        try:
            entry_id, fields = _DECODE.decode(payload)
            _key(entry_id)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            return
        end = offset + _HEADER.size + length
        yield offset, end, ArchivedEntry(entry_id, fields)
        offset = end


def _has_magic(fh: BinaryIO) -> bool:
    fh.seek(0)
    return fh.read(len(MAGIC)) == MAGIC


def _first(path: Path) -> ArchivedEntry | None:
    with contextlib.suppress(OSError), open(path, "rb") as fh:
        if _has_magic(fh):
            for _, _, entry in _records(fh):
                return entry
    return None


def _tail(path: Path) -> tuple[int, ArchivedEntry | None]:
    """End offset of the last whole record of a segment (the magic's end if none) and it."""
    with open(path, "rb") as fh:
        if not _has_magic(fh):
            return 0, None
        end, last = len(MAGIC), None
        for _, record_end, entry in _records(fh):
            end, last = record_end, entry
        return end, last


def read_archive(
    folder: Path, after: str | None = None, before: str | None = None
) -> Iterator[ArchivedEntry]:
    """Archived entries with ``after < id < before`` (either bound optional), in log order.

    Segments wholly at or before ``after`` are skipped unread; a torn record ends its
    segment. A missing folder yields nothing.
    """
    lo = _key(after) if after not in (None, "0", "0-0", "-") else None
    hi = _key(before) if before is not None else None
    paths = segments(folder)
    start = 0
    if lo is not None:
        # The last segment whose first entry is at or before `after` holds what follows it.
        for i, path in enumerate(paths):
            first = _first(path)
            if first is not None and _key(first.id) <= lo:
                start = i
    for path in paths[start:]:
        try:
            fh = open(path, "rb")
        except OSError:
            continue
        with fh:
            if not _has_magic(fh):
                continue
            for _, _, entry in _records(fh):
                key = _key(entry.id)
                if hi is not None and key >= hi:
                    return
                if lo is None or key > lo:
                    yield entry


def last_archived(folder: Path) -> str | None:
    """Id of the newest whole record in ``folder`` (None when there is none)."""
    for path in reversed(segments(folder)):
        _, last = _tail(path)
        if last is not None:
            return last.id
    return None


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _new_segment(folder: Path, after: Path | None) -> Path:
    number = _number(after.name) + 1 if after is not None else 1
    path = folder / f"archive-{number:06d}.rlev"
    atomic_write(path, MAGIC)
    return path


def _last_before(paths: Sequence[Path]) -> str | None:
    for path in reversed(paths):
        _, last = _tail(path)
        if last is not None:
            return last.id
    return None


# Per folder: (tail segment, its size and mtime when we last saw it, whole-record end, newest
# id). An append trusts it only while the file is exactly as we left it; else it re-scans.
_TAILS: dict[Path, tuple[Path, int, int, int, str | None]] = {}


def _tail_state(folder: Path, paths: list[Path]) -> tuple[Path | None, int, str | None]:
    """The tail segment, the end of its last whole record, and the newest archived id."""
    if not paths:
        return None, 0, None
    path = paths[-1]
    cached = _TAILS.get(folder)
    if cached is not None and cached[0] == path:
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if (st.st_size, st.st_mtime_ns) == (cached[1], cached[2]):
                return path, cached[3], cached[4]
    end, last = _tail(path)
    newest = last.id if last is not None else _last_before(paths[:-1])
    with contextlib.suppress(OSError):
        _remember(folder, path, end, newest)
    return path, end, newest


def _remember(folder: Path, path: Path, end: int, newest: str | None) -> None:
    st = os.stat(path)
    _TAILS[folder] = (path, st.st_size, st.st_mtime_ns, end, newest)


def _open_at(path: Path, end: int) -> tuple[BinaryIO, int]:
    """A segment opened to write at ``end`` (the end of its last whole record, a torn record
    after it cut off), and where writing starts."""
    fh = open(path, "r+b")
    if end < len(MAGIC):  # a segment torn before its magic was written
        fh.seek(0)
        fh.write(MAGIC)
        end = len(MAGIC)
    fh.truncate(end)  # cut a torn record off
    fh.seek(end)
    return fh, end


def _close_synced(fh: BinaryIO) -> None:
    fh.flush()
    os.fsync(fh.fileno())
    fh.close()


def append(folder: Path, entries: Sequence[tuple[str, Sequence[bytes]]]) -> int:
    """Append ``entries`` (``(id, raw fields)`` in log order) and fsync; returns how many
    were written. Entries at or before the newest archived one are skipped (so appending a
    range again never duplicates it); a torn tail left by a crash is cut off first."""
    if not entries:
        return 0
    with _locked(folder):
        path, end, newest_id = _tail_state(folder, segments(folder))
        newest = _key(newest_id) if newest_id is not None else None
        fresh = [(i, f) for i, f in entries if newest is None or _key(i) > newest]
        if not fresh:
            return 0
        fh: BinaryIO | None = None
        written = 0
        try:
            for entry_id, fields in fresh:
                key = _key(entry_id)
                if newest is not None and key <= newest:
                    continue  # out of order in the input: never write an older id
                if path is None or end >= SEGMENT_BYTES:
                    if fh is not None:
                        _close_synced(fh)
                        fh = None
                    path = _new_segment(folder, path)
                    end = len(MAGIC)
                if fh is None:
                    fh, end = _open_at(path, end)
                payload = _ENCODE.encode((entry_id, [bytes(f) for f in fields]))
                record = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
                fh.write(record)
                end += len(record)
                newest, newest_id = key, entry_id
                written += 1
        finally:
            if fh is not None:
                _close_synced(fh)
        if path is not None:
            _remember(folder, path, end, newest_id)
        return written


def truncate_from(folder: Path, entry_id: str) -> int:
    """Remove every archived record with id at or after ``entry_id`` (whole later segments
    are deleted, the one holding the cut is cut back); returns how many were removed."""
    cut = _key(entry_id)
    removed = 0
    with _locked(folder):
        paths = segments(folder)
        _, _, newest = _tail_state(folder, paths)
        if newest is None or _key(newest) < cut:
            return 0  # the usual case: nothing archived at or after the cut
        for path in reversed(paths):
            with open(path, "rb") as fh:
                if not _has_magic(fh):
                    keep_end, dropped = 0, 0
                else:
                    keep_end, dropped = len(MAGIC), 0
                    for _, end, entry in _records(fh):
                        if _key(entry.id) >= cut:
                            dropped += 1
                        else:
                            keep_end = end
            if dropped == 0 and keep_end > 0:
                break  # everything here (and before) is older than the cut
            removed += dropped
            if keep_end <= len(MAGIC):
                path.unlink()
                continue
            with open(path, "r+b") as fh:
                fh.truncate(keep_end)
                fh.flush()
                os.fsync(fh.fileno())
            break
        _TAILS.pop(folder, None)
        if removed:
            fsync_path(folder)
    return removed
