"""A collective weight sync with a member lost mid-round: how long the healthy rollouters wait.

``rollout.weights_transport=collective``: the trainer broadcasts each publication over gloo to
the rollouters that lack it (``weights.collective``). One reader killed (SIGKILL) or paused
(SIGSTOP) while the bytes flow used to hold every other reader for gloo's timeout
(``rollout.weights_fetch_timeout_s``, 60 s by default, 600 s here as in weights_sync.py); now
the round is dropped once the member has been silent for ``SILENT_S`` and the others are
served in a new round.

R reader processes (``bench/weights_sync.py``'s, a rollouter's receiver and pulse) hold a
model of SIZE GB (fp32 size, sent in bf16); reader R-1 sends itself the fault in its second
round, once two broadcast pieces are in. Per fault, two syncs side by side: a clean one
(publish -> loaded on every reader) and the faulty one (publish -> loaded on the R-1 healthy
readers); a paused reader is then woken (SIGCONT) and the time until it is served too is
shown.

    python bench/collective_member_lost.py                 # 0.5 GB, 3 readers, kill and stop
    python bench/collective_member_lost.py --size 0.05     # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import torch
from weights_sync import RUN, delete, model, publish, reader_main, receivers_seen, shapes

from bus import Bus, RunKeys
from rlbus.redis_server import EmbeddedRedis
from weights import collective_round
from weights.collective import Broadcaster

FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def faulty_reader_main(url: str, root: str, dims: list[tuple[int, int]], conn: Connection,
                       rank: int, fault: int) -> None:
    """:func:`weights_sync.reader_main` whose receiver sends itself ``fault`` in its second
    round, once two pieces are in (the third in flight)."""
    made: list[collective_round.ChunkCheck] = []
    init, check = collective_round.ChunkCheck.__init__, collective_round.ChunkCheck.__call__

    def counted(self: collective_round.ChunkCheck, *args: object) -> None:
        init(self, *args)  # type: ignore[arg-type]
        made.append(self)

    def checked(self: collective_round.ChunkCheck, end: int) -> None:
        check(self, end)
        if len(made) == 2 and self is made[1] and 2 * collective_round.PIECE <= end < self.m.size:
            made.append(self)  # fires once
            os.kill(os.getpid(), fault)

    collective_round.ChunkCheck.__init__ = counted  # type: ignore[method-assign]
    collective_round.ChunkCheck.__call__ = checked  # type: ignore[method-assign]
    reader_main(url, root, dims, conn, rank)


async def sync(bus: Bus, conns: list[Connection], state: dict[str, torch.Tensor], n: int,
               broadcaster: Broadcaster) -> tuple[float, object]:
    """Publish -> loaded on every reader of ``conns`` (s); the reference, to ask the rest."""
    for c in conns:
        c.send(("hold", "bfloat16"))
    for c in conns:
        assert await asyncio.to_thread(c.recv) == "held"
    t0 = time.monotonic()
    ref = await publish(bus, "", "collective", state, torch.bfloat16, f"weights-v{n}-lost",
                        broadcaster)
    job = ("collective", "bfloat16", msgspec.to_builtins(ref))
    for c in conns:
        c.send(job)
    done = [await asyncio.to_thread(c.recv) for c in conns]
    return max(done) - t0, ref


async def one_fault(url: str, size: float, readers: int, fault: str) -> None:
    dims = shapes(size)
    state = model(dims, torch.float32)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(readers)]
    procs = []
    for rank, (_, child) in enumerate(pipes):
        faulty = rank == readers - 1
        procs.append(ctx.Process(
            target=faulty_reader_main if faulty else reader_main, daemon=True,
            args=(url, "", dims, child, rank, *((FAULTS[fault],) if faulty else ()))))
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]
    for c in conns:
        await asyncio.to_thread(c.recv)  # "ready"
    told: list[str] = []

    async def warn(text: str) -> None:
        told.append(text)

    try:
        async with Bus.from_url(url) as bus:
            broadcaster = Broadcaster(bus, RunKeys(RUN), epoch=f"lost-{fault}",
                                      host="127.0.0.1", timeout_s=600, warn=warn)
            rounds = asyncio.create_task(broadcaster.run())
            await receivers_seen(broadcaster, readers)
            clean, ref = await sync(bus, conns, state, 1, broadcaster)
            await delete(bus, "", "collective", ref, broadcaster)  # type: ignore[arg-type]
            print(f"  {fault}: clean round, {readers} readers: {clean:.2f} s", flush=True)
            for c in conns:
                c.send(("hold", "bfloat16"))
            for c in conns:
                assert await asyncio.to_thread(c.recv) == "held"
            healthy = conns[:-1]
            t0 = time.monotonic()
            ref = await publish(bus, "", "collective", state, torch.bfloat16,
                                "weights-v2-lost", broadcaster)
            job = ("collective", "bfloat16", msgspec.to_builtins(ref))
            for c in conns:
                c.send(job)
            done = [await asyncio.to_thread(c.recv) for c in healthy]
            lost = max(done) - t0
            print(f"  {fault}: reader {readers - 1} lost mid-round: the {readers - 1} others "
                  f"loaded in {lost:.2f} s ({lost / clean:.1f}x the clean round)", flush=True)
            if fault == "stop":
                woke = time.monotonic()
                os.kill(procs[-1].pid, signal.SIGCONT)
                await asyncio.to_thread(conns[-1].recv)
                print(f"  stop: woken (SIGCONT), reader {readers - 1} loaded "
                      f"{time.monotonic() - woke:.2f} s later", flush=True)
            for line in told:
                print(f"  told: {line}", flush=True)
            rounds.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rounds
    finally:
        for c, p in zip(conns, procs, strict=True):
            if p.is_alive():
                with contextlib.suppress(OSError):
                    c.send(None)
        for p in procs:
            await asyncio.to_thread(p.join, 30)
            if p.is_alive():
                print(f"  reader pid {p.pid} did not exit within 30 s: killed", flush=True)
                p.kill()


async def main_async(args: argparse.Namespace) -> None:
    with (tempfile.TemporaryDirectory(prefix="rlbus-lost-") as tmp,
          EmbeddedRedis(Path(tmp) / "redis") as server):
        print(f"{args.size:g} GB (fp32 size; sent in bf16), {args.readers} readers, "
              f"silent after {collective_round.SILENT_S:g} s", flush=True)
        for fault in args.faults.split(","):
            await one_fault(server.url, args.size, args.readers, fault)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=0.5, help="model size in GB (fp32)")
    ap.add_argument("--readers", type=int, default=3, help="reader (rollouter) processes")
    ap.add_argument("--faults", default="kill,stop", help="kill, stop or both")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
