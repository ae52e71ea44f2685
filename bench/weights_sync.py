"""Weight sync: publish -> loaded on 1 and 3 rollouters, today's whole-blob path vs each weight
transport, for models of a few sizes, and a 7B projection.

One publisher (this process, the trainer's part) and R reader processes (the rollouters'
part), each holding a model of the same shapes, against one embedded redis-server (AOF on,
as ``rlbus up`` runs it; ``--no-aof`` to compare). A model is float32 tensors of up to 64 MiB
(16M elements) adding up to the size asked. One sync is timed from the moment the publisher
starts serialising until the last reader has copied every tensor into its model:

  today     ``policy.weights.to_bytes`` (torch.save), sha256 of the whole blob, Redis chunks up
            to 64 MiB or one file above (``weights.blobs``); readers get, verify, ``torch.load``
            (``from_bytes``), copy in
  redis     ``weights.transport.RedisTransport``: a CPU copy in the published dtype (what
            the trainer's worker hands over), chunks hashed and written as produced, manifest;
            readers fetch 8 chunks at a time, verify each, copy in
  storage   ``StorageTransport`` under a local temporary directory (the run's storage)
  collective ``weights.collective``, as a run with ``rollout.weights_transport=collective``
            has it: the publisher's ``Broadcaster`` (manifest in Redis, one flat buffer) serves
            a round (a fresh gloo group of the readers that lack the publication) to the
            readers' ``Receiver`` tasks, which receive into one buffer and check each chunk

Each transport runs in fp32 and in bf16 (half the bytes; the readers hold a bf16 model then).
The table shows publish (until the event could be written), publish -> loaded (the slowest
reader), and the rate in model-MB (fp32 size) per second. The projection for a 7B model
(14 GB in bf16, 28 GB in fp32) scales the largest size's publish -> loaded by bytes, and adds
the floor of one 10 GbE link (1.25 GB/s) that R readers pulling from one server would share.
Everything here runs on one host: no network, the link floor is arithmetic.

    python bench/weights_sync.py                                    # 0.1, 0.5, 2 GB; 1, 3 readers
    python bench/weights_sync.py --sizes 0.05 --readers 1 --repeat 1  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import torch

from bus import Bus, RunKeys, pulse_forever
from policy.weights import from_bytes, to_bytes
from rlbus.redis_server import EmbeddedRedis
from runschema.messages import BlobRef, Heartbeat
from weights.blobs import DirBlobStore, RedisBlobStore, open_store
from weights.collective import Broadcaster, Receiver
from weights.collective_round import Member
from weights.transport import open_transport

RUN = "bench"
LIMIT = 64 * 1024 * 1024  # today's rule: Redis chunks up to 64 MiB, a file above
PIECE = 16 * 1024 * 1024  # elements per tensor (64 MiB in fp32)
LINK_BPS = 1.25e9  # one 10 GbE link
SEVEN_B = 7e9  # parameters


def shapes(size_gb: float) -> list[tuple[int, int]]:
    """Tensor shapes (rows x 4096, and one odd remainder) adding up to ``size_gb`` in fp32."""
    left, out = int(size_gb * 1e9) // 4, []
    while left > 0:
        n = min(PIECE, left)
        rows = max(1, n // 4096)
        out.append((rows, 4096) if rows * 4096 == n else (1, n))
        left -= out[-1][0] * out[-1][1]
    return out


def model(dims: list[tuple[int, int]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.rand(d, generator=g).to(dtype) for i, d in enumerate(dims)}


# --------------------------------------------------------------------------- readers


def transport(bus: Bus, root: str, path: str) -> Any:
    return open_transport(path, bus=bus, run_keys=RunKeys(RUN), root=root)


async def _read(bus: Bus, root: str, path: str, ref: BlobRef,
                receiver: Receiver) -> dict[str, torch.Tensor]:
    keys = RunKeys(RUN)
    if path == "today":
        store = open_store(ref.store, bus=bus, run_keys=keys, root=root)
        blob = await store.get(ref)
        return await asyncio.to_thread(from_bytes, blob)
    if path == "collective":
        return await receiver.take(ref, wait_s=600)
    return await transport(bus, root, path).fetch(ref)


async def _reader(url: str, root: str, dims: list[tuple[int, int]], conn: Connection,
                  rank: int) -> None:
    held: dict[torch.dtype, dict[str, torch.Tensor]] = {}
    keys = RunKeys(RUN)
    async with Bus.from_url(url) as bus:
        # A rollouter's part in the broadcasts: its receiver, and a pulse that says so.
        receiver = Receiver(bus, keys, Member(rank, os.getpid()))
        tasks = [asyncio.create_task(receiver.run()), asyncio.create_task(pulse_forever(
            bus, keys.alive("rollouter", rank),
            lambda: Heartbeat(role="rollouter", rank=rank, pid=os.getpid(),
                              weights_receiver=True), 1.0, 5.0))]
        conn.send("ready")
        while (job := await asyncio.to_thread(conn.recv)) is not None:
            if job[0] == "hold":  # before the clock starts: a rollouter's model is resident
                dtype = getattr(torch, job[1])
                if dtype not in held:
                    held.clear()  # one model at a time: the memory of a rollouter
                    held[dtype] = {f"layer{i}.weight": torch.zeros(d, dtype=dtype)
                                   for i, d in enumerate(dims)}
                conn.send("held")
                continue
            path, dtype_name, raw = job
            dtype = getattr(torch, dtype_name)
            state = await _read(bus, root, path, msgspec.convert(raw, BlobRef), receiver)
            with torch.no_grad():
                for name, t in held[dtype].items():
                    t.copy_(state[name])
            conn.send(time.monotonic())
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def reader_main(url: str, root: str, dims: list[tuple[int, int]], conn: Connection,
                rank: int) -> None:
    torch.set_num_threads(1)
    asyncio.run(_reader(url, root, dims, conn, rank))


# --------------------------------------------------------------------------- publisher


async def publish(bus: Bus, root: str, path: str, state: dict[str, torch.Tensor],
                  dtype: torch.dtype, name: str, broadcaster: Broadcaster) -> BlobRef:
    """One publication as the trainer makes it (serialisation included)."""
    keys = RunKeys(RUN)
    if path == "today":
        blob = await asyncio.to_thread(to_bytes, state)
        store = RedisBlobStore(bus, keys) if len(blob) <= LIMIT else DirBlobStore(root)
        return await store.put(name, blob)

    def snapshot() -> dict[str, torch.Tensor]:  # the worker's copy in the published dtype
        return {k: t.to(dtype=dtype, copy=True) for k, t in state.items()}

    tensors = await asyncio.to_thread(snapshot)
    if path == "collective":  # the rounds start at once (the event would be written now)
        return await broadcaster.publish(name, tensors, 0)
    return await transport(bus, root, path).publish(name, tensors)


async def delete(bus: Bus, root: str, path: str, ref: BlobRef,
                 broadcaster: Broadcaster) -> None:
    keys = RunKeys(RUN)
    if path == "today":
        await open_store(ref.store, bus=bus, run_keys=keys, root=root).delete(ref)
    elif path == "collective":
        await broadcaster.delete(ref)
    else:
        await transport(bus, root, path).delete(ref)


async def one_sync(bus: Bus, root: str, conns: list[Connection], path: str,
                   state: dict[str, torch.Tensor], dtype: torch.dtype,
                   n: int, broadcaster: Broadcaster) -> tuple[float, float]:
    """(publish s, publish -> loaded s on the slowest reader) of one sync. The readers hold
    a model of the published dtype before it starts (making one is not a sync's cost)."""
    for c in conns:
        c.send(("hold", str(dtype).removeprefix("torch.")))
    for c in conns:
        assert await asyncio.to_thread(c.recv) == "held"
    t0 = time.monotonic()
    ref = await publish(bus, root, path, state, dtype, f"weights-v{n}-bench", broadcaster)
    t1 = time.monotonic()
    job = (path, str(dtype).removeprefix("torch."), msgspec.to_builtins(ref))
    for c in conns:
        c.send(job)
    done = [await asyncio.to_thread(c.recv) for c in conns]
    await delete(bus, root, path, ref, broadcaster)
    return t1 - t0, max(done) - t0


async def receivers_seen(broadcaster: Broadcaster, readers: int) -> None:
    """Until the broadcaster sees every reader's pulse (a rollouter's first heartbeat)."""
    for _ in range(600):
        if len(await broadcaster.receivers()) == readers:
            return
        await asyncio.sleep(0.1)
    raise SystemExit(f"only {len(await broadcaster.receivers())} of {readers} receivers "
                     "were seen")


MODES = [("today", torch.float32), ("redis", torch.float32), ("redis", torch.bfloat16),
         ("storage", torch.float32), ("storage", torch.bfloat16),
         ("collective", torch.float32), ("collective", torch.bfloat16)]


def parse_modes(text: str) -> list[tuple[str, torch.dtype]]:
    """``--modes``: ``path:dtype`` items (``collective:bf16,storage:bf16``); all: every one."""
    if text == "all":
        return list(MODES)
    names = {f"{path}:{'bf16' if dtype == torch.bfloat16 else 'fp32'}": (path, dtype)
             for path, dtype in MODES}
    unknown = [item for item in text.split(",") if item not in names]
    if unknown:
        raise SystemExit(f"--modes: {', '.join(unknown)} not among {', '.join(names)}")
    return [names[item] for item in text.split(",")]


async def bench_size(url: str, root: str, size: float, readers: int, repeat: int,
                     modes: list[tuple[str, torch.dtype]]) -> list[dict[str, Any]]:
    dims = shapes(size)
    state = model(dims, torch.float32)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(readers)]
    procs = [ctx.Process(target=reader_main, daemon=True, args=(url, root, dims, child, rank))
             for rank, (_, child) in enumerate(pipes)]
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]
    for c in conns:
        await asyncio.to_thread(c.recv)  # "ready"
    rows: list[dict[str, Any]] = []
    try:
        async with Bus.from_url(url) as bus:
            broadcaster = Broadcaster(bus, RunKeys(RUN), epoch=f"{size}x{readers}",
                                      host="127.0.0.1", timeout_s=600)
            rounds = asyncio.create_task(broadcaster.run())
            await receivers_seen(broadcaster, readers)
            best: dict[tuple[str, torch.dtype], tuple[float, float]] = {}
            n = 0
            for _ in range(repeat):  # interleaved: drift and warm-up hit every mode alike
                for mode in modes:
                    n += 1
                    got = await one_sync(bus, root, conns, mode[0], state, mode[1], n,
                                         broadcaster)
                    if mode not in best or got[1] < best[mode][1]:
                        best[mode] = got
            for (path, dtype), (pub, loaded) in best.items():
                rows.append({"size_gb": size, "readers": readers, "path": path,
                             "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
                             "publish_s": pub, "loaded_s": loaded,
                             "mb_s": size * 1e3 / loaded})
                print(f"  {size:g} GB x{readers} {path:10s} {rows[-1]['dtype']}: publish "
                      f"{pub:.2f} s, loaded {loaded:.2f} s", flush=True)
            rounds.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rounds
    finally:
        for c in conns:
            c.send(None)
        for p in procs:
            p.join(30)
    return rows


def table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'size':>6s} {'readers':>7s} {'path':10s} {'dtype':5s} {'publish s':>10s} "
          f"{'loaded s':>9s} {'MB/s':>8s} {'vs today':>9s}")
    today = {(r["size_gb"], r["readers"]): r["loaded_s"] for r in rows if r["path"] == "today"}
    for r in rows:
        base = today.get((r["size_gb"], r["readers"]))
        ratio = f"{base / r['loaded_s']:8.1f}x" if base else "        -"  # today not run
        print(f"{r['size_gb']:6g} {r['readers']:7d} {r['path']:10s} {r['dtype']:5s} "
              f"{r['publish_s']:10.2f} {r['loaded_s']:9.2f} {r['mb_s']:8.0f} {ratio}")


def projection(rows: list[dict[str, Any]]) -> None:
    """7B: the largest size's publish -> loaded scaled by bytes, and the 10 GbE floor."""
    biggest = max(r["size_gb"] for r in rows)
    print(f"\n7B projection (from {biggest:g} GB; link floor: R readers x bytes / 1.25 GB/s "
          "through one 10 GbE link)")
    for r in (r for r in rows if r["size_gb"] == biggest):
        width = 2 if r["dtype"] == "bf16" else 4
        scale = SEVEN_B * width / (biggest * 1e9 * width / 4)
        local = r["loaded_s"] * scale
        link = r["readers"] * SEVEN_B * width / LINK_BPS
        print(f"  {r['path']:10s} {r['dtype']:5s} x{r['readers']}: {local:7.1f} s here, "
              f">= {link:6.1f} s over one link -> ~{max(local, link):7.1f} s per sync")


async def main_async(args: argparse.Namespace) -> None:
    sizes = [float(s) for s in args.sizes.split(",")]
    counts = [int(s) for s in args.readers.split(",")]
    rows: list[dict[str, Any]] = []
    with (tempfile.TemporaryDirectory(prefix="rlbus-weights-") as tmp,
          EmbeddedRedis(Path(tmp) / "redis", appendonly=not args.no_aof) as server):
        root = str(Path(tmp) / "blobs")
        await asyncio.to_thread(Path(root).mkdir)
        print(f"redis-server {'.'.join(map(str, server.version))} at {server.url}, "
              f"AOF {'off' if args.no_aof else 'on'}, storage {root}", flush=True)
        for size in sizes:
            for readers in counts:
                rows += await bench_size(server.url, root, size, readers, args.repeat,
                                         parse_modes(args.modes))
    table(rows)
    projection(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.1,0.5,2", help="model sizes in GB (fp32)")
    ap.add_argument("--readers", default="1,3", help="reader (rollouter) counts")
    ap.add_argument("--repeat", type=int, default=3, help="syncs per mode (best is shown)")
    ap.add_argument("--no-aof", action="store_true", help="redis-server without AOF")
    ap.add_argument("--modes", default="all",
                    help="path:dtype items to run, e.g. collective:bf16,storage:bf16 (default "
                         "all; without today:fp32 there is no ratio)")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
