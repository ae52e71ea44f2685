"""Checkpoint integrity: what each file of a checkpoint held when it was written, and whether
it still holds it.

Every file of a checkpoint (``step-K.pt``, its snapshot ``step-K.state``, the dcp shards of
``step-K.dcp/``) gets a :class:`~runschema.messages.FileDigest` (size and sha256) that its
``CheckpointSaved`` records. A resume verifies a checkpoint's files against the log before it
loads it (trainer.resume): a flipped byte, a truncated or a missing file makes it fall back to
an older checkpoint instead of training on garbage.

Decisions:

- The ``.pt`` is hashed while it is written (:class:`HashingWriter`: torch.save only appends),
  so a checkpoint costs no second read; the snapshot's bytes are at hand; local dcp shards are
  read back once after the save (they are written by dcp itself).
- Shards on a remote ``run.storage`` are written there by every rank: reading them back
  would download the checkpoint at every save, so only their sizes are recorded (a
  truncation or a missing shard is still caught; a flipped byte in one is not).
- sha256 because it is what the run already uses for weights (weights.transport), and it runs
  at well over 1 GB/s on the worker thread; verification reads the files once, off the loop.

Blocking functions: call them on a worker thread.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import msgspec

from runconfig.paths import local_path
from runschema.messages import FileDigest

__all__ = ["HF_DIGESTS", "HashingWriter", "bytes_digest", "file_digest", "folder_digests",
           "verify_files", "verify_folder", "write_folder_digests"]

_CHUNK = 8 << 20


class HashingWriter:
    """A write-only file that hashes what goes through it (torch.save writes its zip
    sequentially: ``write`` and ``flush`` are all it calls)."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        written = self.fh.write(data)
        view = memoryview(data).cast("B")[:written]
        self.hash.update(view)
        self.size += len(view)
        return written

    def flush(self) -> None:
        self.fh.flush()

    def digest(self) -> FileDigest:
        return FileDigest(size=self.size, sha256=self.hash.hexdigest())


def bytes_digest(data: bytes) -> FileDigest:
    """The digest of a file written whole from ``data``."""
    return FileDigest(size=len(data), sha256=hashlib.sha256(data).hexdigest())


def file_digest(path: Path) -> FileDigest:
    """Size and sha256 of the file at ``path``, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return FileDigest(size=size, sha256=h.hexdigest())


def folder_digests(folder: str, prefix: str) -> dict[str, FileDigest]:
    """The digest of every file under ``folder`` (a local path or an fsspec URL), named
    ``prefix/relative/path``. A remote folder's files get their sizes only (module
    docstring)."""
    root = local_path(folder)
    if root is not None:
        return {f"{prefix}/{p.relative_to(root).as_posix()}": file_digest(p)
                for p in sorted(root.rglob("*")) if p.is_file()}
    from fsspec.core import url_to_fs

    fs, root_path = url_to_fs(folder)
    base = root_path.rstrip("/")
    found: dict[str, FileDigest] = {}
    for path, info in sorted(fs.find(base, detail=True).items()):
        found[f"{prefix}/{path[len(base):].lstrip('/')}"] = FileDigest(size=int(info["size"]))
    return found


def _fault(path: str, want: FileDigest) -> str | None:
    """Why the file at ``path`` is not what ``want`` says it was (None: it is)."""
    local = local_path(path)
    if local is None:
        from fsspec.core import url_to_fs

        fs, where = url_to_fs(path)
        if not fs.exists(where):
            return f"{path} is missing"
        size = int(fs.size(where))
        return None if size == want.size else (
            f"{path} holds {size} bytes, {want.size} were written")
    try:
        size = os.stat(local).st_size
    except FileNotFoundError:
        return f"{path} is missing"
    if size != want.size:
        return f"{path} holds {size} bytes, {want.size} were written (truncated or replaced)"
    if want.sha256 is not None and file_digest(local).sha256 != want.sha256:
        return f"{path} does not hash to the sha256 recorded when it was written (corrupt)"
    return None


def verify_files(files: Mapping[str, FileDigest], where: Mapping[str, str]) -> str | None:
    """Why the checkpoint whose files are ``files`` cannot be trusted (None: every file is
    as written). ``where``: the top-level names (``step-K.pt``, ``step-K.dcp``) to the path
    or URL they are at on this node; a name not in it is taken as missing."""
    for name, want in files.items():
        top, _, rest = name.partition("/")
        base = where.get(top)
        if base is None:
            return f"{name} is missing"
        why = _fault(f"{base.rstrip('/')}/{rest}" if rest else base, want)
        if why is not None:
            return why
    return None


HF_DIGESTS = "rlbus_digests.json"
"""The file in an exported Hugging Face directory (trainer.export) that names every other
file of it with its size and sha256, written before the directory is renamed into place."""


def write_folder_digests(root: Path) -> None:
    """Write :data:`HF_DIGESTS` into ``root``: every file under it with its digest (read
    back once: the exporter's thread, off the trainer's critical path)."""
    digests = {p.relative_to(root).as_posix(): file_digest(p)
               for p in sorted(root.rglob("*")) if p.is_file() and p.name != HF_DIGESTS}
    (root / HF_DIGESTS).write_bytes(msgspec.json.encode(digests))


def verify_folder(root: Path) -> str | None:
    """Why the folder ``root`` (an exported Hugging Face directory, or a copy of it) is not
    what its :data:`HF_DIGESTS` says was written (None: every file is; also None for a
    directory exported before digests were written, which has no such file)."""
    listing = root / HF_DIGESTS
    if not listing.is_file():
        return None
    try:
        digests = msgspec.json.decode(listing.read_bytes(), type=dict[str, FileDigest])
    except msgspec.DecodeError as exc:
        return f"{listing} is unreadable ({exc})"
    for name, want in digests.items():
        why = _fault(str(root / name), want)
        if why is not None:
            return why
    return None
