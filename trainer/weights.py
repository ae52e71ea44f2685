"""Weights publication and the retention of their blobs.

Weights never go in a stream entry: the trainer's worker copies them (in the published
dtype, ``rollout.weights_dtype``), a weight transport (:mod:`bus.weights_transport`) writes
them tensor by tensor in checksummed chunks plus a manifest, and a ``WeightsPublished``
event carries the manifest's reference: the event is the single source of truth (version,
digest). ``rollout.weights_transport``: ``redis`` (chunks in the run's hash slot), ``storage``
(files under the run's blob root), ``auto``: Redis up to :data:`REDIS_BLOB_LIMIT`, storage
above. The publication's name carries the trainer's epoch, so a zombie trainer can never
overwrite the live one's. The newest :data:`KEEP_WEIGHTS` publications stay readable (a
starting rollouter falls back to an older loadable one); each sync deletes the one that fell
out of them, and a resume sweeps what an earlier incarnation left in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import torch

from bus import Bus, RunKeys
from bus.blobs import RedisBlobStore, open_store
from bus.messages import BlobRef, WeightsPublished
from bus.weights_transport import StorageTransport, is_manifest_ref, open_transport
from runtime import Failure
from trainer.writer import Writer

__all__ = ["KEEP_WEIGHTS", "REDIS_BLOB_LIMIT", "Weights", "WeightsUnwritable", "pick_transport"]

REDIS_BLOB_LIMIT = 64 * 1024 * 1024
"""Above this many bytes ``auto`` sends the weights through the storage transport."""

KEEP_WEIGHTS = 3
"""Weight versions whose blobs stay readable."""


class WeightsUnwritable(Failure):
    """The weights could not be written where the transport puts them."""


def pick_transport(setting: str, size: int) -> str:
    """The transport for ``size`` bytes of weights under ``rollout.weights_transport``."""
    if setting != "auto":
        return setting
    return "redis" if size <= REDIS_BLOB_LIMIT else "storage"


class Weights:
    """Publishes the trainer's weights through ``writer``; keeps the newest publications only.
    ``root``: the storage transport's root, also where whole blobs of older logs lie (a
    directory or an fsspec URL: runconfig.paths.blob_root); ``transport``:
    ``rollout.weights_transport``."""

    def __init__(self, bus: Bus, keys: RunKeys, writer: Writer, root: str | os.PathLike[str],
                 epoch: str, *, transport: str = "auto") -> None:
        self.bus = bus
        self.keys = keys
        self.writer = writer
        self.root = root
        self.epoch = epoch
        self.transport = transport

    async def publish(self, version: int, step: int,
                      snapshot: asyncio.Future[dict[str, torch.Tensor]]) -> None:
        """Write the tensors ``snapshot`` resolves to, then announce them as weights
        ``version`` (published after ``step``), then drop the publication that fell out of
        the kept."""
        tensors = await snapshot
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        kind = pick_transport(self.transport, size)
        transport = open_transport(kind, bus=self.bus, run_keys=self.keys, root=self.root)
        name = f"weights-v{version}-{self.epoch}"
        try:
            ref = await transport.publish(name, tensors)
        except OSError as exc:  # the run's storage: full, read-only, gone
            where = self.root if kind == "storage" else "redis"
            raise WeightsUnwritable(f"WeightsUnwritable: weights v{version} could not be "
                                    f"written to {where} ({kind} transport): {exc}") from None
        del tensors
        await self.writer.publish(WeightsPublished(version=version, ref=ref, step=step,
                                                   manifest=ref))
        await self._drop_old()

    async def delete(self, ref: BlobRef) -> None:
        """Delete one publication (a transport's, or a whole blob of an older log)."""
        if is_manifest_ref(ref):
            await open_transport(ref.store, bus=self.bus, run_keys=self.keys,
                                 root=self.root).delete(ref)
        else:
            root = self.root if isinstance(self.root, Path) else Path(self.root)
            await open_store(ref.store, bus=self.bus, run_keys=self.keys, root=root).delete(ref)

    async def _drop_old(self) -> None:
        """Delete the publication that just fell out of the newest KEEP_WEIGHTS, so Redis
        does not grow by a model per sync. Older ones went the same way at earlier syncs
        (or, an earlier incarnation's, in :meth:`sweep` on resume): one delete per sync,
        not one per remembered publication."""
        refs = [ref for _, ref in self.writer.state.weights]
        if len(refs) <= KEEP_WEIGHTS:
            return
        ref = refs[-KEEP_WEIGHTS - 1]
        if ref.key in {r.key for r in refs[-KEEP_WEIGHTS:]}:
            return
        with contextlib.suppress(Exception):  # already gone is fine
            await self.delete(ref)

    async def sweep(self) -> None:
        """On resume: delete weight keys in Redis, and publications in the storage root,
        that no kept publication names (written by an earlier incarnation that died before
        publishing or deleting them)."""
        keep = {ref.key for _, ref in self.writer.state.weights[-KEEP_WEIGHTS:]}
        prefix, store = self.keys.blob("weights-"), RedisBlobStore(self.bus, self.keys)
        await store.delete_chunks([key for key in await store.names()
                                   if key.startswith(prefix)
                                   and key.rsplit(":", 1)[0] not in keep])
        storage = StorageTransport(self.root)
        for name in await storage.names("weights-"):
            if name not in keep:
                await storage.delete_name(name)
