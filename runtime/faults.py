"""Faults of the machine a component runs on, said in one line with their cause.

A full disk reaches a component as whatever the writer raises: ``OSError`` ENOSPC from our
own writes, a ``RuntimeError`` from torch's zip writer (``inline_container.cc ... unexpected
pos``), an fsspec error from a remote store. The component cannot go on either way; what
matters is that its one line says the disk is full, where, and what was being written, instead
of sixty lines of traceback (:func:`disk_full`). Before a checkpoint, :func:`space_warning`
says when the last one would not fit in what is free.
"""

from __future__ import annotations

import errno
import os
import shutil

from runconfig.paths import local_path
from runtime.component import Failure

__all__ = ["LOW_SPACE_BYTES", "DiskFull", "disk_full", "free_bytes", "human", "space_warning"]

LOW_SPACE_BYTES = 64 * 1024 * 1024
"""A write that failed with less than this free where it wrote is taken as a full disk,
whatever the writer raised (torch's zip writer says only "unexpected pos")."""

_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskFull(Failure):
    """A write failed for lack of space: the message names the path, the free bytes and
    what was being written."""


def human(n: float) -> str:
    """``n`` bytes in a unit a person reads (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """The bytes free to us on the file system holding ``path`` (its nearest existing
    folder); None when it cannot be told (a remote URL, a folder gone)."""
    where = local_path(str(path))
    if where is None:
        return None
    while not where.exists():
        if where.parent == where:
            return None
        where = where.parent
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def disk_full(exc: BaseException, path: str | os.PathLike[str], what: str) -> DiskFull | None:
    """The :class:`DiskFull` a failed write of ``what`` under ``path`` is (None: something
    else failed): the error says so (ENOSPC, EDQUOT, EFBIG), or the file system holding
    ``path`` has less than :data:`LOW_SPACE_BYTES` free."""
    code = getattr(exc, "errno", None)
    free = free_bytes(path)
    if code not in _FULL and (free is None or free >= LOW_SPACE_BYTES):
        return None
    where = getattr(exc, "filename", None) or path
    left = "unknown" if free is None else human(free)
    first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
    return DiskFull(f"disk full: writing {what} to {where} failed with {left} free there "
                    f"({type(exc).__name__}: {first}); free space there, then resume the run")


def space_warning(path: str | os.PathLike[str], need: int, what: str) -> str | None:
    """One line when ``what``, about ``need`` bytes, would not fit in what is free under
    ``path`` (None: it fits, or the free space cannot be told)."""
    free = free_bytes(path)
    if free is None or need <= 0 or free >= need:
        return None
    return (f"{what} needs about {human(need)} and {path} has {human(free)} free: it will "
            f"likely fail for lack of space (free some, or lower the checkpoint's size)")
