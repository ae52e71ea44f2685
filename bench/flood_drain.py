"""How fast the trainer's sample path refuses junk: entries/s dead-lettered.

N junk entries go into a run's samples stream before the clock starts: a third undecodable
bytes, a third decodable messages that are not samples, a third samples of tickets never
issued. Then the trainer's path drains them, as trainer.app does it: the fenced consumer
reads (as many as :func:`trainer.core.read_count` asks), the step core judges the read,
and the shell writes the dead letters it asks for. The trainer's log lines go to a file
(their count is printed). One embedded redis-server, AOF on, as ``rlbus up`` runs it.

    python bench/flood_drain.py             # 100 000 entries
    python bench/flood_drain.py --n 20000
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from pathlib import Path

import numpy as np

from bus import Bus, Consumer, Lease, RunKeys
from rlbus.redis_server import EmbeddedRedis
from runconfig import load_config
from runschema.messages import FIELD, Array, Sample, StepStarted, encode
from tasks import build_prompt_source
from trainer.actions import Ack, DeadLetter, Reads
from trainer.core import StepCore
from trainer.ledger import Ledger

KEYS = RunKeys("flood")


def _junk(i: int) -> bytes:
    if i % 3 == 0:
        return b"\xc1junk %d" % i
    if i % 3 == 1:
        return encode(StepStarted(step=i, param_version=0))
    a = Array.of(np.asarray([1, 2], dtype=np.int32))
    return encode(Sample(sample_id=f"x{i}/0", ticket_id=f"t{10**6 + i}", prompt_id="p",
                         index=0, n=1, prompt_tokens=a, response_tokens=a,
                         logprobs=Array.of(np.asarray([-0.1, -0.2], dtype=np.float32)),
                         reward=0.0, min_version=0, max_version=0))


async def _fill(bus: Bus, n: int) -> None:
    batch = 5000
    for start in range(0, n, batch):
        await bus.pipeline([("XADD", KEYS.samples, "*", FIELD, _junk(i))
                            for i in range(start, min(n, start + batch))])


async def _drain(bus: Bus, n: int) -> float:
    cfg = load_config(overrides=[])
    core = StepCore(cfg, build_prompt_source(cfg), KEYS, ledger=Ledger(), version=0,
                    vocab_size=16, max_len=32, now=0.0)
    lease = Lease(bus, KEYS.trainer_lease, "host:1:a", 60.0)
    await lease.acquire()
    consumer = Consumer(bus, KEYS.samples, "trainer", "trainer-a", dlq_stream=KEYS.dlq,
                        fence=lease)
    await consumer.ensure_group()
    t0 = time.perf_counter()
    while consumer.stats.dead_lettered + consumer.stats.acked < n:
        before = consumer.stats.dead_lettered
        deliveries = await consumer.read(count=core.read_size, block_ms=None)
        refused = consumer.stats.dead_lettered - before
        reads = Reads(time.monotonic(), deliveries=deliveries, refused=refused,
                      idle=not deliveries)
        for action in core.take(reads):
            match action:
                case DeadLetter(refusals):
                    await consumer.dead_letter_many(refusals)
                case Ack(entry_ids):
                    await consumer.ack(*entry_ids)
    return time.perf_counter() - t0


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        logfile = Path(tmp) / "trainer.log"
        logging.basicConfig(filename=logfile, level=logging.INFO)
        server = EmbeddedRedis(tmp)
        server.start()
        bus = Bus.from_url(server.url)
        try:
            await _fill(bus, n)
            took = await _drain(bus, n)
            dlq = await bus.command("XLEN", KEYS.dlq)
            dropped = int(await bus.command("GET", KEYS.dlq_dropped) or 0)
        finally:
            await bus.close()
            server.stop()
        lines = len(logfile.read_text().splitlines())
    print(f"{n} junk entries dead-lettered in {took:.2f} s: {n / took:,.0f} entries/s; "
          f"dead-letter stream {dlq} entries, {dropped} dropped by its cap; {lines} log lines")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    asyncio.run(main(parser.parse_args().n))
