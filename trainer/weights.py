"""Weights publication and the retention of their blobs.

Weights never go in a stream entry: the trainer's worker copies them (in the published
dtype, ``rollout.weights_dtype``), a weight transport (:mod:`weights.transport`) writes
them tensor by tensor in checksummed chunks plus a manifest, and a ``WeightsPublished``
event carries the manifest's reference: the event is the single source of truth (version,
digest). ``rollout.weights_transport``: ``redis`` (chunks in the run's hash slot), ``storage``
(files under the run's blob root), ``auto``: Redis up to :data:`REDIS_BLOB_LIMIT`, storage
above; ``collective``: broadcast to the rollouters over gloo by a
:class:`~weights.collective.Broadcaster` (:func:`open_broadcaster`), which holds the
newest publication in memory and serves it in rounds. The publication's name carries the
trainer's epoch, so a zombie trainer can never overwrite the live one's. The newest
:data:`KEEP_WEIGHTS` publications stay readable (a starting rollouter falls back to an older
loadable one); each sync deletes the one that fell out of them, and a resume sweeps what an
earlier incarnation left in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from bus import Bus, RunKeys, local_address, redis_host
from runconfig import Config
from runschema.messages import BlobRef, WarningRaised, WeightsPublished
from runtime import Failure
from runtime.process import expanded_url
from trainer.writer import Writer
from weights.blobs import RedisBlobStore, open_store
from weights.collective import Broadcaster, delete_manifest
from weights.collective_round import STORE
from weights.transport import StorageTransport, is_manifest_ref, open_transport

__all__ = ["KEEP_WEIGHTS", "REDIS_BLOB_LIMIT", "Weights", "WeightsUnwritable",
           "collective_host", "open_broadcaster", "pick_transport"]

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


def collective_host(cfg: Config) -> str:
    """The address rollouters reach the trainer's broadcasts at:
    ``rollout.weights_collective_host``, else this machine's address on the route to Redis
    (which every rollouter reaches too)."""
    if cfg.rollout.weights_collective_host:
        return cfg.rollout.weights_collective_host
    return local_address(redis_host(expanded_url(cfg) or ""))


def open_broadcaster(cfg: Config, bus: Bus, keys: RunKeys, epoch: str,
                     warn: Callable[[WarningRaised], Awaitable[Any]]) -> Broadcaster | None:
    """The trainer's broadcaster when ``rollout.weights_transport`` is ``collective``: a
    round that leaves a receiver without the newest weights is a
    ``weights_broadcast_incomplete`` warning; gloo's timeout is
    ``rollout.weights_fetch_timeout_s``."""
    if cfg.rollout.weights_transport != "collective":
        return None

    async def told(text: str) -> None:
        await warn(WarningRaised(source="trainer", code="weights_broadcast_incomplete",
                                 message=text))

    return Broadcaster(bus, keys, epoch=epoch, host=collective_host(cfg),
                       timeout_s=cfg.rollout.weights_fetch_timeout_s, warn=told)


class Weights:
    """Publishes the trainer's weights through ``writer``; keeps the newest publications only.
    ``root``: the storage transport's root, also where whole blobs of older logs lie (a
    directory or an fsspec URL: runconfig.paths.blob_root); ``transport``:
    ``rollout.weights_transport``; ``broadcaster``: the collective transport's (whose
    :meth:`~weights.collective.Broadcaster.run` the trainer runs as a task)."""

    def __init__(self, bus: Bus, keys: RunKeys, writer: Writer, root: str | os.PathLike[str],
                 epoch: str, *, transport: str = "auto",
                 broadcaster: Broadcaster | None = None) -> None:
        self.bus = bus
        self.keys = keys
        self.writer = writer
        self.root = root
        self.epoch = epoch
        self.transport = transport
        self.broadcaster = broadcaster

    async def published(self, ref: BlobRef) -> dict[str, torch.Tensor] | None:
        """The tensors of one of this run's publications read back (a resume compares its
        model with them), or None where no copy is kept: the broadcast transport's bytes
        live only in the rollouters that received them, an older log's whole blob is not
        read back."""
        if not is_manifest_ref(ref) or ref.store == STORE:
            return None
        transport = open_transport(ref.store, bus=self.bus, run_keys=self.keys, root=self.root)
        return await transport.fetch(ref)

    async def publish(self, version: int, step: int,
                      snapshot: asyncio.Future[dict[str, torch.Tensor]]) -> None:
        """Write the tensors ``snapshot`` resolves to, then announce them as weights
        ``version`` (published after ``step``), then drop the publication that fell out of
        the kept."""
        tensors = await snapshot
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        kind = pick_transport(self.transport, size)
        name = f"weights-v{version}-{self.epoch}"
        try:
            if self.broadcaster is not None:
                ref = await self.broadcaster.publish(name, tensors, version)
            else:
                transport = open_transport(kind, bus=self.bus, run_keys=self.keys,
                                           root=self.root)
                ref = await transport.publish(name, tensors, version)
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
        if ref.store == STORE:
            await delete_manifest(self.bus, self.keys, ref)
        elif is_manifest_ref(ref):
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
