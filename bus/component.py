"""What every component process does with its Bus: run, stop on a signal, close cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable

from bus.errors import BusAuthError, BusUnavailable, redact_url
from bus.messages import Command, StartProfile, StopProfile
from bus.streams import Bus

__all__ = ["bus_error_line", "expand_env", "read_commands", "run_with_bus", "settle_heap"]

CLOSE_TIMEOUT_S = 5.0

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(url: str) -> str:
    """``url`` with every ``${VAR}`` replaced from the environment, so a password can live in
    the environment while configs, logs and the run's RunStarted event keep the placeholder.
    An unset variable raises :class:`KeyError` naming it."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise KeyError(name)
        return os.environ[name]

    return _ENV_REF.sub(sub, url)


def bus_error_line(name: str, exc: BusUnavailable | BusAuthError) -> str:
    """One line for an unreachable Redis or refused credentials: what failed, what to try."""
    if isinstance(exc, BusAuthError):
        return (f"{name}: error: {exc} (check the user and password in redis.url, or the "
                "environment variable it names)")
    return (f"{name}: error: cannot reach Redis at {exc.url} ({exc.op} failed after "
            f"{exc.attempts} attempt(s)); is the server running there? check redis.url")


def settle_heap() -> None:
    """A component's start-up is over: if the garbage collector is off (``rlbus trainer``
    and ``rlbus rollouter`` start with it off), freeze what is alive now (gc.freeze: the
    imports and the model stay out of every later collection) and turn it back on. With the
    collector on (a component run in-process, e.g. under tests) this does nothing."""
    if gc.isenabled():
        return
    gc.freeze()
    gc.enable()


async def read_commands(bus: Bus, control: str, cursor: str) -> tuple[list[Command], str]:
    """New profiling commands on the control stream after ``cursor`` (one non-blocking XREAD):
    ``(commands, new_cursor)``."""
    entries, cursor = await bus.read_after(control, cursor, count=1000)
    return [msg for _, msg in entries if isinstance(msg, StartProfile | StopProfile)], cursor


async def _serve(url: str, name: str, body: Callable[[Bus], Awaitable[int]],
                 stop: asyncio.Event | None, client_name: str | None) -> int:
    try:
        bus = Bus.from_url(expand_env(url), client_name=client_name)
    except KeyError as exc:
        print(f"{name}: error: invalid config key 'redis.url': environment variable "
              f"{exc.args[0]} (named in {redact_url(url)}) is not set", file=sys.stderr)
        return 2
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()

    def on_signal() -> None:
        if stop is not None and not stop.is_set():
            stop.set()  # the body winds down and returns its own exit code
        elif task is not None:
            # Cancelling the task runs every `finally` (traces written, ProfileStopped sent).
            task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)
    try:
        return await body(bus)
    except asyncio.CancelledError:
        print(f"{name}: stopped by signal", file=sys.stderr)
        return 143
    except (BusUnavailable, BusAuthError) as exc:
        # One line, not a traceback: the operator needs the URL and what to try.
        print(bus_error_line(name, exc), file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(bus.close(), CLOSE_TIMEOUT_S)


def run_with_bus(
    url: str,
    name: str,
    body: Callable[[Bus], Awaitable[int]],
    *,
    stop: asyncio.Event | None = None,
    client_name: str | None = None,
) -> int:
    """Run ``body(bus)`` in a fresh event loop: the lifecycle every component process shares.
    SIGTERM/SIGINT/SIGHUP end it with exit code 143; with ``stop``, the first signal sets
    that event instead (the body stops cleanly and returns its own code) and a second one
    ends it. ``${VAR}`` in ``url`` comes from the environment; an unreachable Redis is one
    line on stderr and exit code 1."""
    return asyncio.run(_serve(url, name, body, stop, client_name))
