"""The events archive on a remote run storage (``run.storage`` an fsspec URL): the segments
(storage.archive) the trainer mirrors to ``STORAGE/RUN/events/`` and what a node fetches of them.

The trainer (trainer.mirror) makes its local folder the storage's copy at start
(:func:`segments_to_fetch`). Every other reader of the archive (``rlbus inspect``, the
launcher, the metrics logger, the profiler service) only adds to its local folder what the
storage holds more of (:func:`segments_to_read`, :func:`fetch_for_reading`): it never
uploads, deletes remote files, replaces a longer local segment (on the trainer's node the
trainer may have appended to it since its last upload) nor removes a local one. Every
function that touches the storage blocks (network I/O): call it on a worker thread.
"""

from __future__ import annotations

import re
from pathlib import Path

from runconfig.paths import events_dir, local_path, record_dir, storage_url
from runconfig.schema import Config
from storage.run_storage import RunStorage, StorageError

__all__ = ["RECORD_SEGMENT", "SEGMENT", "fetch_for_reading", "fetch_segments", "local_sizes",
           "segments_to_fetch", "segments_to_read"]

SEGMENT = re.compile(r"^archive-\d{6,}\.rlev$")
"""The name of an events archive segment (storage.archive)."""

RECORD_SEGMENT = re.compile(r"^samples-\d{6,}\.parquet$")
"""The name of a segment of the run's record (storage.record), mirrored the same way to
``STORAGE/RUN/record/``."""


def segments_to_fetch(remote: dict[str, int], local: dict[str, int],
                      pattern: re.Pattern[str] = SEGMENT) -> tuple[list[str], list[str]]:
    """``(fetch, remove)`` at the trainer's start: the remote archive segments (name: size)
    whose local copy is missing or of another size, and the local segments the storage does
    not hold (a stale copy: the storage's is the run's, uploaded before every trim). A
    storage without segments changes nothing."""
    there = {n: size for n, size in remote.items() if pattern.match(n)}
    if not there:
        return [], []
    fetch = [n for n in sorted(there) if local.get(n) != there[n]]
    return fetch, sorted(n for n in local if pattern.match(n) and n not in there)


def segments_to_read(remote: dict[str, int], local: dict[str, int],
                     pattern: re.Pattern[str] = SEGMENT) -> list[str]:
    """The remote segments a reader fetches: those missing locally or shorter here than
    there (an older copy). A longer local segment is kept (the trainer of this node may
    have appended to it since it last uploaded), and nothing local is removed."""
    return [n for n in sorted(remote)
            if pattern.match(n) and local.get(n, -1) < remote[n]]


def local_sizes(folder: Path) -> dict[str, int]:
    """The files directly in ``folder`` and their sizes ({} when it does not exist)."""
    if not folder.is_dir():
        return {}
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}


def fetch_segments(storage: RunStorage, prefix: str, folder: Path, names: list[str]) -> None:
    """Download the segments ``names`` of ``prefix/`` into ``folder`` (each atomically)."""
    for name in names:
        storage.download(f"{prefix}/{name}", folder / name)


def fetch_for_reading(cfg: Config, run_id: str, record: bool = False) -> list[str]:
    """Add to run ``run_id``'s local events folder (runconfig.paths.events_dir; with
    ``record``, its record folder: runconfig.paths.record_dir) the segments the remote
    storage holds more of (:func:`segments_to_read`); returns their names. On a local
    storage nothing (the folder is in it). Raises :class:`StorageError` naming the URL when
    the storage cannot be read."""
    url = storage_url(cfg)
    if local_path(url) is not None:
        return []
    prefix, folder, pattern = ((f"{run_id}/record", record_dir(cfg, run_id), RECORD_SEGMENT)
                               if record else (f"{run_id}/events", events_dir(cfg, run_id),
                                               SEGMENT))
    try:
        storage = RunStorage(url)
        wanted = segments_to_read(storage.sizes(prefix), local_sizes(folder), pattern)
        fetch_segments(storage, prefix, folder, wanted)
    except StorageError:
        raise
    except Exception as exc:  # any backend's error: permission, network, credentials
        raise StorageError(url, f"{type(exc).__name__}: {exc}") from exc
    return wanted
