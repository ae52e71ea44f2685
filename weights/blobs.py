"""Blob stores: claim checks for payloads too large for a stream entry (weights).

A store writes the bytes and returns a :class:`~runschema.messages.BlobRef` (store, key, size,
sha256, chunks); the event that announces the blob carries only the reference. Reading
verifies size and sha256, so a reader never uses a torn or corrupted payload.

- :class:`RedisBlobStore` (``store="redis"``): chunks ``KEY:0 .. KEY:N-1`` under the run's
  ``blob(name)`` key prefix (same hash slot as the run's streams), written in one MULTI/EXEC.
- :class:`DirBlobStore` (``store="dir"``): one file per blob under a root directory, written
  atomically (temp file, fsync, rename). Keys are relative paths; ``..`` and absolute paths
  are refused.
- :func:`open_store` picks the store a reference points at.

All methods are coroutines; file I/O runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Protocol

from bus import BlobCorrupt, BlobError, BlobNotFound, Bus, RunKeys
from runschema.messages import BlobRef
from storage.files import atomic_write

__all__ = ["DEFAULT_CHUNK_SIZE", "BlobStore", "DirBlobStore", "RedisBlobStore", "open_store"]

DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
"""4 MiB: far below Redis' 512 MB bulk limit, small enough to keep pipelines smooth."""


class BlobStore(Protocol):
    """What both stores offer (tests/test_blobs.py holds one suite both pass)."""

    store: str
    """The ``BlobRef.store`` of its blobs."""

    async def put(self, name: str, data: bytes | bytearray | memoryview) -> BlobRef:
        """Store ``data`` as blob ``name`` (overwriting); its reference."""
        ...

    async def get(self, ref: BlobRef) -> bytes:
        """The blob's bytes, verified: wrong size or sha256 is :class:`BlobCorrupt`, no blob
        :class:`BlobNotFound`, another store's reference :class:`BlobError`."""
        ...

    async def delete(self, ref: BlobRef) -> None:
        """Remove the blob (missing is fine)."""
        ...


def _verify(ref: BlobRef, data: bytes) -> bytes:
    if len(data) != ref.size:
        raise BlobCorrupt(f"blob {ref.key!r} has {len(data)} bytes, reference says {ref.size}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256:
        raise BlobCorrupt(f"blob {ref.key!r} sha256 {digest} != reference {ref.sha256}")
    return data


class RedisBlobStore(BlobStore):
    """Blobs as chunked strings in Redis, under ``run_keys.blob(name)``."""

    store = "redis"

    def __init__(self, bus: Bus, run_keys: RunKeys, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.bus = bus
        self.run_keys = run_keys
        self.chunk_size = chunk_size

    async def put(self, name: str, data: bytes | bytearray | memoryview) -> BlobRef:
        """Store ``data`` as blob ``name`` (overwriting). Wraps MULTI; SET KEY:i ...; EXEC."""
        view = memoryview(data).cast("B")
        key = self.run_keys.blob(name)
        size = len(view)
        chunks = max(1, -(-size // self.chunk_size))

        def prepare() -> tuple[str, list[bytes]]:
            # Hashing and copying a model are seconds of CPU: never on the event loop.
            return hashlib.sha256(view).hexdigest(), [
                bytes(view[i * self.chunk_size : (i + 1) * self.chunk_size])
                for i in range(chunks)
            ]

        sha, parts = await asyncio.to_thread(prepare)
        # One transaction: a reader never sees half of a new blob and half of an old one.
        # The blob's chunk keys are listed in the run's blobs set (a sweep finds them
        # without SCAN, which would show every run's key names).
        chunk_keys = [f"{key}:{i}" for i in range(len(parts))]
        await self.bus.pipeline(
            [*(("SET", k, part) for k, part in zip(chunk_keys, parts, strict=True)),
             ("SADD", self.run_keys.blobs, *chunk_keys)], atomic=True
        )
        return BlobRef(store=self.store, key=key, size=size, sha256=sha, chunks=chunks)

    async def get(self, ref: BlobRef) -> bytes:
        """The blob's bytes, verified. Wraps MGET. Missing chunk, wrong size or sha256 →
        :class:`BlobCorrupt`; no chunk at all → :class:`BlobNotFound`."""
        if ref.store != self.store:
            raise BlobError(f"reference to a {ref.store!r} blob given to the redis store")
        keys = [f"{ref.key}:{i}" for i in range(max(ref.chunks, 1))]
        parts: list[bytes | None] = await self.bus.command("MGET", *keys)
        missing = [k for k, p in zip(keys, parts, strict=True) if p is None]
        if len(missing) == len(keys):
            raise BlobNotFound(f"blob {ref.key!r} does not exist (deleted, or another Redis?)")
        if missing:
            raise BlobCorrupt(f"blob {ref.key!r} is missing chunk(s) {', '.join(missing)}")
        return await asyncio.to_thread(
            lambda: _verify(ref, b"".join(p for p in parts if p is not None))
        )

    async def delete(self, ref: BlobRef) -> None:
        """Remove the blob's chunks. Wraps DEL and SREM (one transaction)."""
        chunk_keys = [f"{ref.key}:{i}" for i in range(max(ref.chunks, 1))]
        await self.bus.pipeline([("DEL", *chunk_keys), ("SREM", self.run_keys.blobs,
                                                        *chunk_keys)], atomic=True)

    async def delete_chunks(self, chunk_keys: Sequence[str]) -> None:
        """Remove chunk keys found in :meth:`names` (a sweep). Wraps DEL and SREM."""
        if chunk_keys:
            await self.bus.pipeline([("DEL", *chunk_keys),
                                     ("SREM", self.run_keys.blobs, *chunk_keys)], atomic=True)

    async def names(self) -> list[str]:
        """The chunk keys of every blob stored for the run. Wraps SMEMBERS."""
        return sorted(k.decode() for k in await self.bus.command("SMEMBERS",
                                                                 self.run_keys.blobs))


class DirBlobStore(BlobStore):
    """Blobs as files under ``root``; ``BlobRef.key`` is the path relative to ``root``."""

    store = "dir"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()

    def path_of(self, key: str) -> Path:
        """The file for ``key``; refuses absolute paths and anything escaping ``root``."""
        rel = PurePosixPath(key)
        if not key or rel.is_absolute() or ".." in rel.parts or "\\" in key or "\0" in key:
            raise BlobError(f"blob key {key!r} must be a relative path without '..'")
        path = (self.root / rel).resolve()
        if not path.is_relative_to(self.root):
            raise BlobError(f"blob key {key!r} escapes the store root {self.root}")
        return path

    @staticmethod
    def _write(path: Path, data: memoryview) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # 0600 as before: a blob (weights) is for the run's user only.
        atomic_write(path, data, mode=0o600)

    async def put(self, name: str, data: bytes | bytearray | memoryview) -> BlobRef:
        """Write blob ``name`` (a relative path) atomically; returns its reference."""
        path = self.path_of(name)
        view = memoryview(data).cast("B")
        sha = await asyncio.to_thread(lambda: hashlib.sha256(view).hexdigest())
        await asyncio.to_thread(self._write, path, view)
        return BlobRef(store=self.store, key=name, size=len(view), sha256=sha, chunks=0)

    async def get(self, ref: BlobRef) -> bytes:
        """The blob's bytes, verified (size, sha256 → :class:`BlobCorrupt`)."""
        if ref.store != self.store:
            raise BlobError(f"reference to a {ref.store!r} blob given to the dir store")
        path = self.path_of(ref.key)
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise BlobNotFound(f"blob file {path} does not exist") from None
        return await asyncio.to_thread(_verify, ref, data)

    async def delete(self, ref: BlobRef) -> None:
        """Remove the blob's file (missing is fine)."""
        path = self.path_of(ref.key)
        await asyncio.to_thread(lambda: path.unlink(missing_ok=True))


def open_store(
    store: str,
    *,
    bus: Bus | None = None,
    run_keys: RunKeys | None = None,
    root: str | os.PathLike[str] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> BlobStore:
    """The store named by ``store`` (a ``BlobRef.store``): ``"redis"`` needs ``bus`` and
    ``run_keys``; ``"dir"`` needs ``root``."""
    if store == "redis":
        if bus is None or run_keys is None:
            raise BlobError("the redis blob store needs bus= and run_keys=")
        return RedisBlobStore(bus, run_keys, chunk_size=chunk_size)
    if store == "dir":
        if root is None:
            raise BlobError("the dir blob store needs root=")
        return DirBlobStore(root)
    raise BlobError(f"unknown blob store {store!r} (expected 'redis' or 'dir')")
