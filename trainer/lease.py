"""Becoming the run's only trainer: take the fencing lease, or name the live holder.

The lease itself (token check on every write) is :class:`bus.liveness.Lease`; this module is
the start-up policy around it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time

from bus import Lease
from runconfig import HeartbeatConfig
from runtime import Failure
from runtime.ranks import pid_dead

__all__ = ["TrainerConflict", "acquire", "token"]


class TrainerConflict(Failure):
    """Another live trainer holds this run's lease; the message names it (nothing is
    written about it: the log is the other trainer's)."""

    publish = False


def token(epoch: str) -> str:
    """This process's lease token: ``host:pid:epoch``."""
    return f"{socket.gethostname()}:{os.getpid()}:{epoch}"


async def acquire(lease: Lease, run_id: str, hb: HeartbeatConfig) -> None:
    """Take ``lease``, or raise :class:`TrainerConflict` naming the live holder.

    A holder on this host whose process is gone is replaced at once; any other holder is
    watched for one lease period: if it renews, it is alive; if its lease runs out, it was
    dead (a crash on another host) and we take over.
    """
    deadline = time.monotonic() + hb.timeout_s + 2 * hb.interval_s
    first: tuple[float, int] | None = None  # (when, ttl) of the first look at the holder
    while True:
        holder = await lease.acquire()
        if holder is None:
            return
        host, _, rest = holder.partition(":")
        pid_text = rest.partition(":")[0]
        if host == socket.gethostname() and pid_text.isdigit() and pid_dead(int(pid_text)):
            if await lease.steal(holder):
                return
            continue
        ttl, now = await lease.remaining_ms(), time.monotonic()
        if first is None:
            first = (now, ttl)
            print(f"trainer: lease {lease.key} held by {holder}; checking whether it is alive "
                  f"(it lapses in {ttl / 1000:.0f} s unless renewed)", file=sys.stderr,
                  flush=True)
        elif ttl > first[1] - (now - first[0]) * 1000 + 250:
            # A TTL that does not run down is being renewed: its holder is alive.
            raise TrainerConflict(
                f"another trainer is running run {run_id!r}: {holder} renews the lease "
                f"{lease.key}; stop it first (one trainer per run)"
            )
        if now > deadline:
            raise TrainerConflict(f"the lease of run {run_id!r} stays held by {holder}")
        await asyncio.sleep(hb.interval_s)
