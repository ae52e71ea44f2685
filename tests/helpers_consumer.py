"""A consumer-group member as a real process, for crash tests (run as a script).

    python tests/helpers_consumer.py URL STREAM GROUP NAME COUNT ACK_FIRST

Reads until it holds COUNT deliveries, acks the first ACK_FIRST of them, prints one JSON line
``{"acked": [ids], "held": [ids]}`` and then blocks on stdin until it is killed (or stdin
closes). Exits 3 if COUNT deliveries do not arrive within 30 s.
"""

from __future__ import annotations

import asyncio
import json
import sys

from bus import Bus, Consumer
from tests.waits import wait_until


async def main(url: str, stream: str, group: str, name: str, count: int, ack_first: int) -> int:
    bus = Bus.from_url(url)
    consumer = Consumer(bus, stream, group, name)
    got: list[str] = []

    async def held_all() -> bool | None:
        deliveries = await consumer.read(count=count - len(got), block_ms=500)
        got.extend(d.id for d in deliveries)
        return True if len(got) >= count else None

    try:
        await wait_until(held_all, f"{count} deliveries of {stream} to {group}/{name}", 30)
    except AssertionError as exc:
        print(exc, file=sys.stderr, flush=True)
        return 3
    await consumer.ack(*got[:ack_first])
    print(json.dumps({"acked": got[:ack_first], "held": got[ack_first:]}), flush=True)
    # Hold the unacked entries until SIGKILL: the parent decides when we "crash".
    await asyncio.to_thread(sys.stdin.read)
    await bus.close()
    return 0


if __name__ == "__main__":
    url, stream, group, name, count, ack_first = sys.argv[1:7]
    sys.exit(asyncio.run(main(url, stream, group, name, int(count), int(ack_first))))
