"""What writing a long value costs the writer's event loop: the bus vs redis-py given bytes.

redis-py packs a command's arguments with hiredis when it is installed, and hiredis copies
every argument into the command it builds; given a memoryview, redis-py packs with its own
code, which sends an argument longer than its buffer cut-off as it is. The bus hands long
bytes over as views (``bus.client._wire_args``). Each write here is the trainer's one-chunk
weights publication: MULTI, SADD, SET chunk, SET manifest, EXEC, in one round trip.

  bus    ``Bus.pipeline`` (the views)
  bytes  the same transaction through redis-py's own pipeline, given the bytes

Both run against one embedded redis-server, interleaved (``--repeat`` rounds, the best of
each kept), for chunks of ``--sizes`` bytes (0.4 MiB: the default tiny policy's weights;
4 MiB: ``weights.transport.CHUNK_SIZE``, every chunk of a larger model). Prints the writer's
CPU (its thread's time) and wall time per write, and the ratio.

    .venv/bin/python bench/wire_copy.py [--sizes 417280 4194304] [--writes 40] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

from bus import Bus
from rlbus.redis_server import EmbeddedRedis

__all__ = ["main"]


def _commands(data: bytes) -> list[tuple[str | bytes, ...]]:
    return [("SADD", "blobs", "w:0", "w:m"), ("SET", "w:0", data), ("SET", "w:m", b"manifest")]


async def _timed(url: str, mode: str, data: bytes, writes: int) -> tuple[float, float]:
    """CPU and wall seconds per write."""
    import redis.asyncio as aioredis

    bus = Bus.from_url(url)
    bare = aioredis.Redis.from_url(url)
    try:

        async def once() -> None:
            if mode == "bus":
                await bus.pipeline(_commands(data), atomic=True)
                return
            pipe = bare.pipeline(transaction=True)
            for args in _commands(data):
                pipe.execute_command(*args)
            await pipe.execute()

        await once()  # connections open, scripts and pools warm
        cpu, wall = time.thread_time(), time.perf_counter()
        for _ in range(writes):
            await once()
        return (time.thread_time() - cpu) / writes, (time.perf_counter() - wall) / writes
    finally:
        await bus.close()
        await bare.aclose()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[417_280, 4 * 1024 * 1024])
    ap.add_argument("--writes", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp, \
            EmbeddedRedis(tmp, appendonly=False) as server:
        print(f"{'bytes':>9s} {'mode':5s} {'CPU ms/write':>13s} {'wall ms/write':>14s}")
        for size in args.sizes:
            data = os.urandom(size)
            best: dict[str, tuple[float, float]] = {}
            for _ in range(args.repeat):
                for mode in ("bytes", "bus"):  # interleaved: drift hits both alike
                    cpu, wall = asyncio.run(_timed(server.url, mode, data, args.writes))
                    if mode not in best or cpu < best[mode][0]:
                        best[mode] = (cpu, wall)
            for mode, (cpu, wall) in best.items():
                print(f"{size:9d} {mode:5s} {1e3 * cpu:13.2f} {1e3 * wall:14.2f}")
            print(f"{size:9d} CPU bytes / bus: {best['bytes'][0] / best['bus'][0]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
