"""Atomic file writes: the one way rlbus replaces a file on disk.

Pure file code (no Redis, no numpy): any package may import it, ``rlbus up`` included.

Decisions:

- **Readers see the old file or the whole new one**, never a torn one: the bytes go to a
  temporary file in the same folder (same file system, so the rename is atomic), which then
  replaces the target with ``os.replace``. A failed write removes the temporary file and
  leaves the target as it was.
- **Durable by default**: the temporary file is fsynced before the rename (a crash must not
  publish a file whose data is still in the page cache) and the folder after it (so that
  the rename itself survives a crash). ``durable=False`` skips both, for files that are
  cheap to lose.
- Temporary files are hidden and named ``.tmp-NAME.RANDOM``: a crash can leave one behind,
  never under the target's name.
- Permissions follow the umask like ``open(path, "w")`` (``mode`` before the umask,
  default ``0o666``).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_file", "atomic_write", "fsync_path", "numbered_files"]

_TMP_PREFIX = ".tmp-"


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a folder (a folder: so that a new or renamed entry in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike[str], *, durable: bool = True, mode: int = 0o666
) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; on a clean exit it replaces
    ``path`` whole (see the module docstring), on an exception nothing changes.

    For writers that stream (a gzip, a pickle); :func:`atomic_write` when the bytes are at
    hand. The folder must exist.
    """
    target = Path(path)
    tmp = target.with_name(f"{_TMP_PREFIX}{target.name}.{secrets.token_hex(4)}")
    # O_EXCL: never write into a file someone else is writing.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_path(target.parent)


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | bytearray | memoryview,
    *,
    durable: bool = True,
    mode: int = 0o666,
) -> None:
    """Replace ``path`` with ``data``, atomically (and durably unless ``durable=False``):
    a temporary file in the same folder, write, fsync, ``os.replace``, fsync the folder."""
    with atomic_file(path, durable=durable, mode=mode) as fh:
        fh.write(data)


def numbered_files(folder: Path, name: re.Pattern[str]) -> list[Path]:
    """The files of ``folder`` whose name ``name`` matches, by the number its first group
    captures (segment files: ``archive-000007.rlev``, ``samples-000007.parquet``); [] when
    the folder does not exist."""
    try:
        found = [(int(m[1]), n) for n in os.listdir(folder) if (m := name.match(n))]
    except FileNotFoundError:
        return []
    return [folder / n for _, n in sorted(found)]
