"""Throughput and latency of the sample path: our bus vs bare redis-py vs a Ray actor queue.

N real ``Sample`` messages (64 prompt + 256 response int32 token ids, 256 float32 log-probs:
~2.4 KB encoded) go from a producer process to a consumer process, side by side in one run:

  bus    ``Bus.publish_many`` batches -> ``Consumer.read`` + ``Consumer.ack`` (consumer group)
  bare   redis-py: pipelines of ``batch`` XADDs -> XREADGROUP COUNT ``batch`` + XACK
  ray    an async Ray actor holding a deque + asyncio.Condition, in the style of verl's
         fully-async MessageQueue: one awaited put and one awaited get per sample

bus and bare run against one embedded redis-server (AOF on, as ``rlbus up`` runs it); every
mode encodes with ``runschema.messages.encode`` and decodes with ``runschema.messages.decode``, so
only the transport differs. Latency is consumer receive time minus the producer's timestamp in the
message. Unpaced (the default) the producer sends as fast as it can, so latency includes
queueing behind earlier samples when the producer outruns the consumer; ``--rate`` paces the
producer below capacity to see the transport's own latency.

    python bench/bus_throughput.py                    # 20 000 samples, unpaced
    python bench/bus_throughput.py --n 2000 --skip-ray
    python bench/bus_throughput.py --rate 5000        # latency below saturation
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections import deque
from typing import Any

import numpy as np
from redis.utils import HIREDIS_AVAILABLE

from bus import Bus, Consumer
from rlbus.redis_server import EmbeddedRedis
from runschema.messages import Array, Sample, decode, encode

STREAM = "rlbus:{bench}:samples"
GROUP = "trainer"

_PROMPT = Array.of(np.arange(64, dtype=np.int32))
_RESPONSE = Array.of(np.arange(256, dtype=np.int32) + 1000)
_LOGPROBS = Array.of(-np.random.default_rng(0).random(256, dtype=np.float32))


def make_sample(i: int) -> Sample:
    """Sample ``i`` stamped with the current time (the producer timestamp)."""
    return Sample(
        sample_id=f"bench-{i // 8}/{i % 8}",
        ticket_id=f"bench-{i // 8}",
        prompt_id=f"p{i // 8}",
        index=i % 8,
        n=8,
        prompt_tokens=_PROMPT,
        response_tokens=_RESPONSE,
        logprobs=_LOGPROBS,
        reward=float(i % 2),
        min_version=3,
        max_version=3,
        ts=time.time(),
    )


def _behind(t0: float, sent: int, rate: float) -> float:
    """Seconds to wait before sending message ``sent`` at ``rate``/s (0 = unpaced)."""
    return 0.0 if rate <= 0 else t0 + sent / rate - time.time()


# --------------------------------------------------------------------------- bus


async def _bus_producer(url: str, n: int, batch: int, rate: float) -> float:
    async with Bus.from_url(url) as bus:
        t0 = time.time()
        for start in range(0, n, batch):
            if (wait := _behind(t0, start, rate)) > 0:
                await asyncio.sleep(wait)
            await bus.publish_many(
                STREAM, [make_sample(i) for i in range(start, min(n, start + batch))]
            )
        return t0


async def _bus_consumer(url: str, n: int, batch: int) -> list[float]:
    lat: list[float] = []
    async with Bus.from_url(url) as bus:
        consumer = Consumer(bus, STREAM, GROUP, "c0")
        while len(lat) < n:
            deliveries = await consumer.read(count=batch, block_ms=1000)
            now = time.time()
            lat += [now - d.msg.ts for d in deliveries]
            if deliveries:
                await consumer.ack(*deliveries)
    return lat


# --------------------------------------------------------------------------- bare redis-py


async def _bare_producer(url: str, n: int, batch: int, rate: float) -> float:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(url)
    t0 = time.time()
    for start in range(0, n, batch):
        if (wait := _behind(t0, start, rate)) > 0:
            await asyncio.sleep(wait)
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(n, start + batch)):
            pipe.xadd(STREAM, {b"m": encode(make_sample(i))})
        await pipe.execute()
    await r.aclose()
    return t0


async def _bare_consumer(url: str, n: int, batch: int) -> list[float]:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(url)
    lat: list[float] = []
    while len(lat) < n:
        reply = await r.xreadgroup(GROUP, "c0", {STREAM: ">"}, count=batch, block=1000)
        if not reply:
            continue
        now = time.time()
        entries = reply[0][1]
        lat += [now - decode(fields[b"m"]).ts for _, fields in entries]
        await r.xack(STREAM, GROUP, *(eid for eid, _ in entries))
    await r.aclose()
    return lat


# --------------------------------------------------------------------------- process plumbing

_MODES = {"bus": (_bus_producer, _bus_consumer), "bare": (_bare_producer, _bare_consumer)}


def _child(
    role: str, mode: str, url: str, n: int, batch: int, rate: float, out: Any, ready: Any
) -> None:
    producer, consumer = _MODES[mode]
    cpu0 = time.process_time()
    if role == "consumer":
        ready.set()
        lat = asyncio.run(consumer(url, n, batch))
        out.put(("consumer", time.time(), lat, time.process_time() - cpu0))
    else:
        ready.wait(30)
        t0 = asyncio.run(producer(url, n, batch, rate))
        out.put(("producer", t0, None, time.process_time() - cpu0))


def run_redis_mode(mode: str, url: str, n: int, batch: int, rate: float) -> dict[str, float]:
    """One producer process and one consumer process through a fresh stream and group."""

    async def reset() -> None:
        async with Bus.from_url(url) as bus:
            await bus.delete(STREAM)
            await Consumer(bus, STREAM, GROUP, "c0").ensure_group()

    asyncio.run(reset())
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ready = ctx.Event()
    procs = [
        ctx.Process(target=_child, args=(role, mode, url, n, batch, rate, out, ready))
        for role in ("consumer", "producer")
    ]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        role, t, lat, cpu = out.get(timeout=600)
        results[role] = (t, lat, cpu)
    for p in procs:
        p.join(60)
    t0, _, cpu_p = results["producer"]
    t_end, lat, cpu_c = results["consumer"]
    summary = _summary(n, t_end - t0, lat)
    # Client CPU per message (producer + consumer processes): robust to a busy machine.
    summary["cpu_us"] = (cpu_p + cpu_c) / n * 1e6
    return summary


# --------------------------------------------------------------------------- ray


def run_ray_mode(n: int, rate: float) -> dict[str, float]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:

        @ray.remote(num_cpus=0)
        class MessageQueue:
            """verl-style queue: a deque guarded by an asyncio.Condition in an async actor."""

            def __init__(self) -> None:
                self.queue: deque[bytes] = deque()
                self.cond: asyncio.Condition | None = None

            def _condition(self) -> asyncio.Condition:
                # Created lazily: it must belong to the actor's event loop.
                if self.cond is None:
                    self.cond = asyncio.Condition()
                return self.cond

            async def put_sample(self, sample: bytes) -> bool:
                async with self._condition():
                    self.queue.append(sample)
                    self._condition().notify_all()
                return True

            async def get_sample(self) -> bytes:
                async with self._condition():
                    while not self.queue:
                        await self._condition().wait()
                    return self.queue.popleft()

        @ray.remote(num_cpus=1)
        def producer(queue: Any, n: int, rate: float) -> float:
            t0 = time.time()
            for i in range(n):
                if (wait := _behind(t0, i, rate)) > 0:
                    time.sleep(wait)
                ray.get(queue.put_sample.remote(encode(make_sample(i))))
            return t0

        @ray.remote(num_cpus=1)
        def consumer(queue: Any, n: int) -> tuple[float, list[float]]:
            lat = []
            for _ in range(n):
                raw = ray.get(queue.get_sample.remote())
                lat.append(time.time() - decode(raw).ts)
            return time.time(), lat

        queue = MessageQueue.remote()
        ray.get(queue.put_sample.remote(b"warm-up"))
        ray.get(queue.get_sample.remote())
        c = consumer.remote(queue, n)
        p = producer.remote(queue, n, rate)
        t0 = ray.get(p, timeout=1200)
        t_end, lat = ray.get(c, timeout=1200)
        return _summary(n, t_end - t0, lat)
    finally:
        ray.shutdown()


# --------------------------------------------------------------------------- report


def _summary(n: int, seconds: float, lat: list[float]) -> dict[str, float]:
    assert len(lat) == n, f"received {len(lat)} of {n}"
    q = statistics.quantiles(lat, n=100)
    return {"msgs_per_s": n / seconds, "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3, "s": seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=20_000, help="samples per mode (default 20000)")
    ap.add_argument("--batch", type=int, default=64, help="pipeline / read batch (default 64)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of bus and bare, best kept")
    ap.add_argument("--skip-ray", action="store_true", help="do not run the Ray queue")
    ap.add_argument("--ray-n", type=int, default=None, help="samples for Ray (default --n)")
    ap.add_argument(
        "--rate", type=float, default=0.0, help="producer msgs/s (default 0: as fast as it can)"
    )
    ap.add_argument("--no-aof", action="store_true", help="run redis without AOF")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = ap.parse_args(argv)

    size = len(encode(make_sample(0)))
    parser = "hiredis" if HIREDIS_AVAILABLE else "pure-Python"
    pace = f"paced at {args.rate:.0f} msgs/s" if args.rate > 0 else "unpaced"
    print(
        f"{args.n} samples of {size} B, batch {args.batch}, {pace}, {parser} RESP parser",
        flush=True,
    )
    results: dict[str, dict[str, float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp,
        EmbeddedRedis(tmp, appendonly=not args.no_aof) as server,
    ):
        print(f"redis-server {'.'.join(map(str, server.version))} at {server.url}", flush=True)
        for _ in range(args.repeat):
            for mode in ("bare", "bus"):  # interleaved: drift hits both alike
                r = run_redis_mode(mode, server.url, args.n, args.batch, args.rate)
                print(f"  {mode:5s} run: {r['msgs_per_s']:9.0f} msgs/s", flush=True)
                if mode not in results or r["msgs_per_s"] > results[mode]["msgs_per_s"]:
                    results[mode] = r
    if not args.skip_ray:
        results["ray"] = run_ray_mode(args.ray_n or args.n, args.rate)

    print(f"\n{'mode':6s} {'msgs/s':>10s} {'p50 ms':>9s} {'p99 ms':>9s} {'client CPU us/msg':>18s}")
    for mode, r in results.items():
        cpu = f"{r['cpu_us']:18.1f}" if "cpu_us" in r else f"{'-':>18s}"
        print(f"{mode:6s} {r['msgs_per_s']:10.0f} {r['p50_ms']:9.1f} {r['p99_ms']:9.1f} {cpu}")
    bus_rate = results["bus"]["msgs_per_s"]
    ratios = {"bus/bare": bus_rate / results["bare"]["msgs_per_s"]}
    if "ray" in results:
        ratios["bus/ray"] = bus_rate / results["ray"]["msgs_per_s"]
    print("  ".join(f"{k} = {v:.2f}x" for k, v in ratios.items()))
    if args.json:
        print(json.dumps({"n": args.n, "bytes": size, "results": results, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
