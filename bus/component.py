"""What every component process does with its Bus: run, stop on a signal, close cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable

from bus.messages import Command, StartProfile, StopProfile
from bus.streams import Bus

__all__ = ["read_commands", "run_with_bus"]

CLOSE_TIMEOUT_S = 5.0


async def read_commands(bus: Bus, control: str, cursor: str) -> tuple[list[Command], str]:
    """New profiling commands on the control stream after ``cursor`` (one non-blocking XREAD):
    ``(commands, new_cursor)``."""
    entries, cursor = await bus.read_after(control, cursor, count=1000)
    return [msg for _, msg in entries if isinstance(msg, StartProfile | StopProfile)], cursor


async def _serve(url: str, name: str, body: Callable[[Bus], Awaitable[int]]) -> int:
    bus = Bus.from_url(url)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Cancelling the task runs every `finally` (traces written, ProfileStopped sent).
        loop.add_signal_handler(sig, lambda: task.cancel() if task else None)
    try:
        return await body(bus)
    except asyncio.CancelledError:
        print(f"{name}: stopped by signal", file=sys.stderr)
        return 143
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(bus.close(), CLOSE_TIMEOUT_S)


def run_with_bus(url: str, name: str, body: Callable[[Bus], Awaitable[int]]) -> int:
    """Run ``body(bus)`` in a fresh event loop; SIGTERM/SIGINT end it with exit code 143."""
    return asyncio.run(_serve(url, name, body))
