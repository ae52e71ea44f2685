"""Weights publication and the retention of their blobs.

Weights never go in a stream entry: they are written to a blob store (claim check, sha256
checked by every reader: Redis chunks, or a directory above :data:`REDIS_BLOB_LIMIT`) and a
``WeightsPublished`` event carries the reference. The blob's name carries the trainer's
epoch, so a zombie trainer can never overwrite the live one's. The newest
:data:`KEEP_WEIGHTS` publications stay readable (a starting rollouter falls back to an older
loadable one); each sync deletes the one that fell out of them, and a resume sweeps what an
earlier incarnation left.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from bus import Bus, RunKeys
from bus.blobs import DirBlobStore, RedisBlobStore, open_store
from bus.messages import WeightsPublished
from trainer.writer import Writer

__all__ = ["KEEP_WEIGHTS", "REDIS_BLOB_LIMIT", "Weights"]

REDIS_BLOB_LIMIT = 64 * 1024 * 1024
"""Above this many bytes the weights go to a directory blob store instead of Redis chunks."""

KEEP_WEIGHTS = 3
"""Weight versions whose blobs stay readable."""


class Weights:
    """Publishes the trainer's weights through ``writer``; keeps the newest blobs only."""

    def __init__(self, bus: Bus, keys: RunKeys, writer: Writer, run_dir: Path,
                 epoch: str) -> None:
        self.bus = bus
        self.keys = keys
        self.writer = writer
        self.root = run_dir / "blobs"
        self.epoch = epoch
        self.blobs: RedisBlobStore | DirBlobStore = RedisBlobStore(bus, keys)

    async def publish(self, version: int, step: int, serialised: asyncio.Future[bytes]) -> None:
        """Put the blob ``serialised`` resolves to, then announce it as weights ``version``
        (published after ``step``), then drop the publication that fell out of the kept."""
        blob = await serialised
        if len(blob) > REDIS_BLOB_LIMIT and not isinstance(self.blobs, DirBlobStore):
            self.blobs = DirBlobStore(self.root)
        ref = await self.blobs.put(f"weights-v{version}-{self.epoch}", blob)
        await self.writer.publish(WeightsPublished(version=version, ref=ref, step=step))
        await self._drop_old()

    async def _drop_old(self) -> None:
        """Delete the blob of the publication that just fell out of the newest KEEP_WEIGHTS,
        so Redis does not grow by a model per sync. Older ones went the same way at earlier
        syncs (or, an earlier incarnation's, in :meth:`sweep` on resume): one delete per
        sync, not one per remembered publication."""
        refs = [ref for _, ref in self.writer.state.weights]
        if len(refs) <= KEEP_WEIGHTS:
            return
        ref = refs[-KEEP_WEIGHTS - 1]
        if ref.key in {r.key for r in refs[-KEEP_WEIGHTS:]}:
            return
        store = open_store(ref.store, bus=self.bus, run_keys=self.keys, root=self.root)
        with contextlib.suppress(Exception):  # already gone is fine
            await store.delete(ref)

    async def sweep(self) -> None:
        """On resume: delete weight blobs in Redis that no kept publication names (written
        by an earlier incarnation that died before publishing or deleting them)."""
        keep = {ref.key for _, ref in self.writer.state.weights[-KEEP_WEIGHTS:]}
        prefix, store = self.keys.blob("weights-"), RedisBlobStore(self.bus, self.keys)
        await store.delete_chunks([key for key in await store.names()
                                   if key.startswith(prefix)
                                   and key.rsplit(":", 1)[0] not in keep])
