"""A collective weight transport: the manifest through Redis, the chunks by broadcast.

:class:`CollectiveTransport` (``"weights:collective"``) writes the manifest of a publication
to Redis (``KEY:m`` under the run's blob prefix, as :class:`~bus.weights_transport.RedisTransport`
does: the event still names it and carries its digest), then the publisher's :meth:`send`
broadcasts the chunks over a ``torch.distributed`` process group (gloo on CPU) from rank
``src``, and every other member's :meth:`fetch` receives them, checking each chunk's sha256
against the manifest as with the other transports.

A collective needs every member of the group in every broadcast, in the same order: each
reader must fetch every publication, none may skip a superseded one, and the group is fixed
when it is formed. The rollouter's double buffer does skip superseded publications and
replicas come and go, so this transport is not selectable by ``rollout.weights_transport``
yet: the benchmark (``bench/weights_sync.py``) and the tests drive it. A member that dies
makes the others' broadcast fail after the group's timeout (a named error, not a hang).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from bus.errors import BlobCorrupt, BlobError, BlobNotFound
from bus.keys import RunKeys
from bus.messages import BlobRef
from bus.streams import Bus
from bus.weights_transport import (
    CHUNK_SIZE,
    FORMAT,
    Manifest,
    _chunks,
    _entries,
    _place,
    _tensors,
    _unique,
    decode_manifest,
    encode_manifest,
)

__all__ = ["CollectiveTransport"]


class CollectiveTransport:
    """Manifest in Redis, chunks broadcast from ``src`` over ``group`` (the default group
    when None, initialised by the caller)."""

    store = "weights:collective"

    def __init__(self, bus: Bus, run_keys: RunKeys, *, src: int = 0, group: Any = None,
                 chunk_size: int = CHUNK_SIZE) -> None:
        if not dist.is_initialized():
            raise BlobError("the collective weights transport needs an initialised "
                            "torch.distributed process group")
        self.bus, self.run_keys = bus, run_keys
        self.src, self.group, self.chunk_size = src, group, chunk_size
        self.outgoing: dict[str, list[bytes]] = {}

    async def publish(self, name: str, tensors: Mapping[str, torch.Tensor]) -> BlobRef:
        """Cut and hash the chunks (worker thread), write the manifest (wraps SADD, SET);
        the chunks wait for :meth:`send`."""
        key = self.run_keys.blob(name)

        def build() -> tuple[list[bytes], bytes, int]:
            unique, aliases = _unique(tensors)
            entries, size = _entries(unique)
            chunks = list(_chunks(unique, self.chunk_size))
            m = Manifest(FORMAT, self.chunk_size, size, entries,
                         [hashlib.sha256(c).digest() for c in chunks], aliases)
            return chunks, encode_manifest(m), size

        chunks, data, size = await asyncio.to_thread(build)
        await self.bus.command("SADD", self.run_keys.blobs, f"{key}:m")
        await self.bus.command("SET", f"{key}:m", data)
        self.outgoing[key] = chunks
        return BlobRef(store=self.store, key=key, size=size,
                       sha256=hashlib.sha256(data).hexdigest(), chunks=len(chunks))

    async def send(self, ref: BlobRef) -> None:
        """Broadcast the chunks of ``ref`` (after its event is written: the readers join
        when they read it). Blocks until every member has taken part."""
        chunks = self.outgoing.pop(ref.key)

        def go() -> None:
            for chunk in chunks:
                t = torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
                dist.broadcast(t, self.src, group=self.group)

        await asyncio.to_thread(go)

    async def fetch(self, ref: BlobRef) -> dict[str, torch.Tensor]:
        """Read the manifest (wraps GET), take part in the broadcast of every chunk, check
        each one's sha256, and return the tensors (views of one buffer)."""
        if ref.store != self.store:
            raise BlobError(f"reference to a {ref.store!r} publication given to {self.store}")
        data: bytes | None = await self.bus.command("GET", f"{ref.key}:m")
        if data is None:
            raise BlobNotFound(f"weights manifest {ref.key}:m does not exist")
        m = decode_manifest(ref, data)

        def go() -> bytearray:
            buf = bytearray(m.size)
            for i in range(len(m.chunks)):
                start = i * m.chunk_size
                t = torch.empty(min(m.chunk_size, m.size - start), dtype=torch.uint8)
                dist.broadcast(t, self.src, group=self.group)
                _place(m, buf, i, t.numpy().tobytes(), ref.key)
            return buf

        try:
            buf = await asyncio.to_thread(go)
        except RuntimeError as exc:  # a member gone: gloo's timeout
            raise BlobCorrupt(f"weights {ref.key!r}: broadcast failed: {exc}") from None
        return await asyncio.to_thread(_tensors, m, buf)

    async def delete(self, ref: BlobRef) -> None:
        """Remove the manifest (the chunks were never stored). Wraps DEL and SREM."""
        self.outgoing.pop(ref.key, None)
        await self.bus.pipeline([("DEL", f"{ref.key}:m"),
                                 ("SREM", self.run_keys.blobs, f"{ref.key}:m")], atomic=True)

    def location(self, ref: BlobRef) -> str:
        return f"broadcast from rank {self.src} (manifest: redis key {ref.key}:m)"
