"""Checkpoints on a remote run storage (``run.storage`` an fsspec URL such as ``s3://...``).

A checkpoint is a file the trainer opens locally, so it is written to the local checkpoint
folder (:func:`runconfig.paths.checkpoint_dir`, under ``run.output_dir/RUN`` on a remote
storage) and mirrored to ``STORAGE/RUN/checkpoints/``; the local folder is a cache:

- after ``write_checkpoint``, :meth:`CheckpointMirror.upload` copies ``step-K.pt`` and then
  ``step-K.state`` (a remote snapshot never lacks its checkpoint), before the
  CheckpointSaved that names them is published;
- at start, before the log is read, :meth:`CheckpointMirror.download_missing` fetches every
  remote pair the local folder lacks, so a trainer started on another node finds them;
- retention deletes a dropped checkpoint's remote copies too (the snapshot first, its
  Hugging Face directory last).

The Hugging Face directory of a checkpoint (``hf_model`` in trainer.checkpoint_contents,
trainer.export) is mirrored to ``STORAGE/RUN/checkpoints/global_step_K/actor/huggingface/``
by the exporter's thread once it is written locally (:meth:`CheckpointMirror.upload_hf`):
every file, then the completion marker :data:`HF_COMPLETE` last, which lists them. A reader
(:meth:`CheckpointMirror.download_hf`) takes a remote directory only with its marker, so it
never sees half a directory: an upload cut short, or one being replaced, has none (the
marker is deleted first, also when retention deletes the directory).

The events archive (``run.retention=checkpoint``: storage.archive segments under
``run.output_dir/RUN/events``) is mirrored to ``STORAGE/RUN/events/`` the same way
(:class:`EventsMirror`): the segments that changed are uploaded after the archive is
written and before the stream is trimmed (the storage's copy holds everything trimmed),
and at start the local folder is made equal to the storage's copy when it has one. The
segment decisions and the fetch are runtime.events_archive's, shared with the other readers
of the archive (which only download).

The log names a checkpoint by its path on the node that wrote it: :meth:`locate` finds it
by name in this node's folder. Every method blocks (network I/O): call it on a worker
thread. On a local storage there is no mirror (:func:`checkpoint_mirror` is None): the
checkpoint folder is already the storage.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from runconfig.paths import checkpoint_dir, events_dir, local_path, record_dir, storage_url
from runconfig.schema import Config
from runtime.events_archive import (
    RECORD_SEGMENT,
    SEGMENT,
    fetch_segments,
    local_sizes,
    segments_to_fetch,
)
from storage.run_storage import RunStorage
from trainer.export import hf_dir, step_folder

__all__ = ["HF_COMPLETE", "SEGMENT", "CheckpointMirror", "EventsMirror", "checkpoint_mirror",
           "events_mirror", "hf_files", "record_mirror", "remote_names", "segments_to_fetch",
           "segments_to_push",
           "to_download", "upload_order"]

HF_COMPLETE = ".rlbus-complete"
"""The marker written last into a remote Hugging Face directory: JSON ``{"step": K,
"files": {name: size}}``; without it the directory is incomplete."""

_PAIR = re.compile(r"^step-(\d+)\.(pt|state)$")


def _pair(step: int) -> tuple[str, str]:
    return f"step-{step:06d}.pt", f"step-{step:06d}.state"


def upload_order(pt: Path) -> list[Path]:
    """The files of the checkpoint ``pt`` in upload order: the ``.pt``, then its
    ``.state`` (a snapshot found remotely always has its checkpoint there)."""
    return [pt, pt.with_suffix(".state")]


def to_download(remote: Iterable[str], local: Iterable[str]) -> list[str]:
    """The remote files to fetch: of each pair whole in ``remote`` and not whole in
    ``local``, the files ``local`` lacks, oldest step first and the ``.pt`` before its
    ``.state`` (a snapshot found locally always has its checkpoint). A remote ``.pt``
    without its ``.state`` (an upload cut short) is not fetched."""
    there, here = set(remote), set(local)
    steps = sorted({int(m[1]) for name in there if (m := _PAIR.match(name))})
    wanted: list[str] = []
    for step in steps:
        pair = _pair(step)
        if all(n in there for n in pair):
            wanted.extend(n for n in pair if n not in here)
    return wanted


def remote_names(steps: Iterable[int]) -> list[str]:
    """The remote files of the dropped checkpoints ``steps``, in deletion order: each
    ``.state`` before its ``.pt`` (a snapshot never names a deleted checkpoint)."""
    return [name for step in sorted(steps) for name in reversed(_pair(step))]


def hf_files(target: Path) -> list[str]:
    """The files of the local Hugging Face directory ``target``, as names relative to it
    (``/``-separated, sorted), in upload order; never a marker of ours."""
    return sorted(p.relative_to(target).as_posix() for p in target.rglob("*")
                  if p.is_file() and p.name != HF_COMPLETE)


def _rel(path: Path) -> str:
    """A layout path of trainer.export (built on ``Path()``) as a storage name."""
    return path.as_posix()


class CheckpointMirror:
    """The checkpoint folder ``folder`` mirrored to ``prefix/`` in ``storage``."""

    def __init__(self, storage: RunStorage, folder: Path, prefix: str) -> None:
        self.storage = storage
        self.folder = folder
        self.prefix = prefix.strip("/")

    def _name(self, file: str) -> str:
        return f"{self.prefix}/{file}"

    def where(self) -> str:
        """The remote folder, as a URL (what a message names)."""
        return f"{self.storage.url.rstrip('/')}/{self.prefix}"

    def upload(self, pt: Path) -> None:
        """Copy the checkpoint ``pt`` and its snapshot to the storage (blocking)."""
        for path in upload_order(pt):
            self.storage.upload(path, self._name(path.name))

    def download_missing(self) -> list[str]:
        """Fetch the remote checkpoints the local folder lacks (:func:`to_download`);
        returns the names fetched (blocking)."""
        here = [p.name for p in self.folder.iterdir()] if self.folder.is_dir() else []
        wanted = to_download(self.storage.list(self.prefix), here)
        for name in wanted:
            self.storage.download(self._name(name), self.folder / name)
        return wanted

    def delete(self, steps: Iterable[int]) -> None:
        """Remove the remote copies of the checkpoints ``steps``, each with its Hugging
        Face directory, in the local folder's order (trainer.retention) (blocking)."""
        steps = sorted(steps)
        for name in remote_names(steps):
            self.storage.delete(self._name(name))
        for step in steps:  # its dcp shards (trainer.learner writes them here), once unnamed
            self.storage.delete_folder(self._name(f"step-{step:06d}.dcp"))
        self.delete_hf(steps)

    def _hf(self, step: int) -> str:
        return self._name(_rel(hf_dir(Path(), step)))

    def hf_where(self, step: int) -> str:
        """The remote Hugging Face directory of checkpoint ``step``, as a URL."""
        return f"{self.where()}/{_rel(hf_dir(Path(), step))}"

    def has_hf(self, step: int) -> bool:
        """Whether the remote Hugging Face directory of ``step`` is whole (its marker)."""
        return self.storage.exists(f"{self._hf(step)}/{HF_COMPLETE}")

    def upload_hf(self, target: Path, step: int) -> None:
        """Copy the local Hugging Face directory ``target`` of checkpoint ``step`` to the
        storage, replacing a copy there (a step trained again): the old marker and files
        first, then every file, then the marker (blocking)."""
        remote = self._hf(step)
        self.storage.delete(f"{remote}/{HF_COMPLETE}")
        self.storage.delete_folder(remote)  # files an older export of this step had
        files: dict[str, int] = {}
        for name in hf_files(target):
            path = target / name
            files[name] = path.stat().st_size
            self.storage.upload(path, f"{remote}/{name}")
        marker = json.dumps({"step": step, "files": files}, sort_keys=True)
        self.storage.write_bytes(f"{remote}/{HF_COMPLETE}", marker.encode())

    def download_hf(self, step: int, target: Path) -> bool:
        """Copy the remote Hugging Face directory of checkpoint ``step`` into ``target``:
        False (nothing copied) when it is not complete there, i.e. has no marker (blocking;
        FileNotFoundError when retention deletes it meanwhile)."""
        remote = self._hf(step)
        try:
            marker = json.loads(self.storage.read_bytes(f"{remote}/{HF_COMPLETE}"))
        except FileNotFoundError:
            return False
        for name in sorted(marker["files"]):
            self.storage.download(f"{remote}/{name}", target / name)
        return True

    def delete_hf(self, steps: Iterable[int]) -> None:
        """Remove the remote Hugging Face directories (``global_step_K``) of ``steps``:
        each marker first (blocking)."""
        for step in sorted(steps):
            self.storage.delete(f"{self._hf(step)}/{HF_COMPLETE}")
            self.storage.delete_folder(self._name(_rel(step_folder(Path(), step))))

    def locate(self, path: str) -> str:
        """The local copy of the checkpoint the log names as ``path`` (written on any
        node): the file of that name in this node's folder."""
        return str(self.folder / Path(path).name)


def checkpoint_mirror(cfg: Config, run_id: str) -> CheckpointMirror | None:
    """The mirror of run ``run_id``'s checkpoints, None when the storage is local (the
    checkpoint folder is in it). Raises storage.run_storage.StorageError for an unusable URL
    (runtime.storage.check_storage said so at start)."""
    url = storage_url(cfg)
    if local_path(url) is not None:
        return None
    return CheckpointMirror(RunStorage(url), checkpoint_dir(cfg, run_id),
                            f"{run_id}/checkpoints")


def segments_to_push(local: dict[str, int], sent: dict[str, int],
                     pattern: re.Pattern[str] = SEGMENT) -> tuple[list[str], list[str]]:
    """``(upload, delete)`` before a trim: the local segments whose size differs from what
    was last sent (``sent``), and the sent ones no longer here (truncated away)."""
    here = {n: size for n, size in local.items() if pattern.match(n)}
    return ([n for n in sorted(here) if sent.get(n) != here[n]],
            sorted(n for n in sent if n not in here))


class EventsMirror:
    """The events archive folder ``folder`` mirrored to ``prefix/`` in ``storage`` (the
    run's record folder too: segments named by ``pattern``)."""

    def __init__(self, storage: RunStorage, folder: Path, prefix: str,
                 pattern: re.Pattern[str] = SEGMENT) -> None:
        self.storage = storage
        self.folder = folder
        self.prefix = prefix.strip("/")
        self.pattern = pattern
        self.sent: dict[str, int] = {}  # what the storage holds, as this process knows it

    def where(self) -> str:
        """The remote folder, as a URL (what a message names)."""
        return f"{self.storage.url.rstrip('/')}/{self.prefix}"

    def fetch(self) -> list[str]:
        """Make the local archive the storage's copy (:func:`segments_to_fetch`); returns
        the segments fetched (blocking)."""
        remote = self.storage.sizes(self.prefix)
        fetch, remove = segments_to_fetch(remote, local_sizes(self.folder), self.pattern)
        fetch_segments(self.storage, self.prefix, self.folder, fetch)
        for name in remove:
            (self.folder / name).unlink(missing_ok=True)
        self.sent = {n: size for n, size in remote.items() if self.pattern.match(n)}
        return fetch

    def push(self) -> None:
        """Upload the segments that changed since the last push (blocking)."""
        local = local_sizes(self.folder)
        upload, delete = segments_to_push(local, self.sent, self.pattern)
        for name in upload:
            self.storage.upload(self.folder / name, f"{self.prefix}/{name}")
            self.sent[name] = local[name]
        for name in delete:
            self.storage.delete(f"{self.prefix}/{name}")
            self.sent.pop(name, None)


def record_mirror(cfg: Config, run_id: str) -> EventsMirror | None:
    """The mirror of run ``run_id``'s record (trainer.record), None when the storage is
    local: its segments go to ``STORAGE/RUN/record/`` before the samples they hold are
    trimmed, as the archive's do before the events are."""
    url = storage_url(cfg)
    if local_path(url) is not None:
        return None
    return EventsMirror(RunStorage(url), record_dir(cfg, run_id), f"{run_id}/record",
                        RECORD_SEGMENT)


def events_mirror(cfg: Config, run_id: str) -> EventsMirror | None:
    """The mirror of run ``run_id``'s events archive, None when the storage is local."""
    url = storage_url(cfg)
    if local_path(url) is not None:
        return None
    return EventsMirror(RunStorage(url), events_dir(cfg, run_id), f"{run_id}/events")
