"""A run's storage (``run.storage``): a local folder or any fsspec URL, read and written by
relative names.

Every call blocks (file or network I/O): components call them on a worker thread
(``asyncio.to_thread``), never on the event loop. On a local storage (a plain path or
``file://``) a write is atomic and durable (:func:`storage.files.atomic_write`: a reader sees the
old bytes or the new ones, never a torn file); on an object store a put is atomic by itself.

Class
    ``RunStorage(url)``: ``exists``, ``read_bytes``, ``write_bytes``, ``list``, ``sizes``,
    ``delete``, ``delete_folder``, ``upload``, ``download``, ``probe``; :class:`StorageError`
    names the URL and why it cannot be used.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Sequence
from typing import Protocol

from storage.files import atomic_write, fsync_path

__all__ = ["PROBE_PREFIX", "RunStorage", "StorageError"]

PROBE_PREFIX = ".rlbus-probe-"
"""Name of the small file :meth:`RunStorage.probe` writes and deletes."""


class StorageError(Exception):
    """The storage at ``url`` cannot be used: ``reason`` says why (unknown protocol, a
    backend package that is not installed, no access, unreachable)."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


class _Filesystem(Protocol):
    """What is read of an fsspec filesystem here (fsspec ships no type information)."""

    protocol: str | tuple[str, ...]


def _protocols(fs: _Filesystem) -> Sequence[str]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _check_name(name: str) -> str:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"storage name {name!r} must be a relative path without '..'")
    return name


class RunStorage:
    """Files under ``url`` (a local path or an fsspec URL), by relative name."""

    def __init__(self, url: str | os.PathLike[str]) -> None:
        self.url = os.fspath(url)
        try:
            from fsspec.core import url_to_fs

            self.fs, self.root = url_to_fs(self.url)
        except ImportError as exc:  # fsspec knows the protocol; its backend is missing
            raise StorageError(self.url, f"its backend is not installed ({exc})") from exc
        except ValueError as exc:  # "Protocol not known"
            raise StorageError(self.url, f"unknown protocol ({exc})") from exc
        self.local = "file" in _protocols(self.fs)

    def path(self, name: str) -> str:
        """The full path (in the filesystem's terms) of ``name``."""
        return f"{self.root.rstrip('/')}/{_check_name(name)}"

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.path(name)))

    def read_bytes(self, name: str) -> bytes:
        """The bytes of ``name`` (FileNotFoundError when there is none)."""
        return bytes(self.fs.cat_file(self.path(name)))

    def write_bytes(self, name: str, data: bytes) -> None:
        """Replace ``name`` with ``data`` whole (atomic and fsynced on a local storage)."""
        path = self.path(name)
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write(path, data)
        else:
            self.fs.pipe_file(path, data)

    def upload(self, local: str | os.PathLike[str], name: str) -> None:
        """Copy the local file ``local`` to ``name`` (streamed, never whole in memory)."""
        path = self.path(name)
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self.fs.put_file(os.fspath(local), path)

    def download(self, name: str, local: str | os.PathLike[str]) -> None:
        """Copy ``name`` to the local file ``local``, atomically and durably: a crash leaves
        no torn file under that name (FileNotFoundError when ``name`` does not exist)."""
        target = os.fspath(local)
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        tmp = f"{target}.part-{secrets.token_hex(4)}"
        try:
            self.fs.get_file(self.path(name), tmp)
            fsync_path(tmp)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_path(os.path.dirname(os.path.abspath(target)))

    def list(self, folder: str = "") -> list[str]:
        """The names of the files directly in ``folder`` (sorted; [] when it does not
        exist), relative to it."""
        base = self.root.rstrip("/") + ("/" + _check_name(folder) if folder else "")
        try:
            found = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        names = [str(f["name"]).rstrip("/").rsplit("/", 1)[-1] for f in found
                 if f.get("type") == "file"]
        return sorted(names)

    def sizes(self, folder: str = "") -> dict[str, int]:
        """The files directly in ``folder`` and their sizes in bytes ({} when it does not
        exist)."""
        base = self.root.rstrip("/") + ("/" + _check_name(folder) if folder else "")
        try:
            found = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return {}
        return {str(f["name"]).rstrip("/").rsplit("/", 1)[-1]: int(f.get("size") or 0)
                for f in found if f.get("type") == "file"}

    def delete(self, name: str) -> None:
        """Remove ``name`` (nothing when it is already gone)."""
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            return

    def delete_folder(self, folder: str) -> None:
        """Remove ``folder`` and every file under it (nothing when it is already gone).
        No order among its files: a folder with a completion marker deletes the marker
        first (:meth:`delete`), so no reader trusts what is left half way."""
        path = self.path(folder)
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except FileNotFoundError:  # deleted meanwhile by another node's retention
            return

    def probe(self, write: bool) -> None:
        """Check that the storage can be read (its root listed) and, with ``write``, that a
        small file can be written, read back and deleted there. A root that does not exist
        yet holds nothing to read; nothing is created to probe it: a missing local root must
        lie in a folder that can be written (by ``write``), a remote one is taken as empty.
        Raises :class:`StorageError` naming the URL and the reason."""
        try:
            if not self.fs.exists(self.root):
                if self.local and write:
                    _check_creatable(self.root)
                return
            self.fs.ls(self.root, detail=False)
            if write:
                name = f"{PROBE_PREFIX}{secrets.token_hex(6)}"
                self.write_bytes(name, b"rlbus")
                if self.read_bytes(name) != b"rlbus":
                    raise StorageError(self.url, "a file written there reads back different")
                self.delete(name)
        except StorageError:
            raise
        except Exception as exc:  # any backend's error: permission, network, credentials
            raise StorageError(self.url, f"{type(exc).__name__}: {exc}") from exc


def _check_creatable(root: str) -> None:
    """A missing local folder ``root`` can be created: its nearest existing ancestor is a
    folder this process may write (PermissionError / NotADirectoryError otherwise)."""
    parent = os.path.dirname(os.path.abspath(root))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise NotADirectoryError(f"{parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{parent} cannot be written")
