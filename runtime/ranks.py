"""Joining a run with a rank claimed on the bus (:mod:`bus.ranks`): the start-up policy
around the claim, as :mod:`trainer.lease` is the trainer's around its lease.

``rank=None``: the lowest rank no process holds. An explicit rank held by another process:
a holder on this host whose process is gone (a crash, then a restart with the same rank) is
replaced at once; any other holder is watched: a claim that is extended (its TTL does not
run down) has a live holder, and the new process exits 2 naming it (:class:`RankTaken`); one
that runs out was a dead holder's, and the rank is taken once it lapsed. The watch is
bounded by the heartbeat timeout plus two intervals, and says what it waits for.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from bus import Bus, RankClaim, RankHeld, RunKeys, claim_lowest_rank, holder_pid_host, holder_token
from runconfig import Config, HeartbeatConfig
from runtime.component import Failure

__all__ = ["RankTaken", "join_rank", "local_holder_gone", "pid_dead"]

RENEWED_MARGIN_MS = 250
"""How far a claim's TTL may sit above its run-down (PTTL's rounding, a round trip's delay)
before it counts as extended by a live holder."""


class RankTaken(Failure):
    """The rank asked for (``rollout.rank``) is held by another live process: exit 2, as a
    config value that cannot work; nothing of the run is written."""

    code = 2
    publish = False


def local_holder_gone(holder: str) -> bool:
    """Whether ``holder`` (``PID@HOST/NONCE``) names a process of this host that is gone
    (or this very process's pid: an earlier incarnation in a restarted container)."""
    parsed = holder_pid_host(holder)
    if parsed is None or parsed[1] != socket.gethostname():
        return False
    pid = parsed[0]
    return pid == os.getpid() or pid_dead(pid)


def pid_dead(pid: int) -> bool:
    """Whether local process ``pid`` is gone (a zombie counts as gone). Shared with the
    trainer's lease, which decides the same question about a local holder."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the pid exists
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


async def join_rank(cfg: Config, bus: Bus, role: str, rank: int | None,
                    say: Callable[[str], None]) -> RankClaim:
    """Claim rank ``rank`` of ``role`` (None: the lowest free one) for the heartbeat
    timeout (liveness's TTL); the pulse extends it. Raises :class:`RankTaken`."""
    keys, hb = RunKeys(cfg.run.id or ""), cfg.heartbeat
    try:
        if rank is None:
            return await claim_lowest_rank(bus, keys, role, hb.timeout_s)
        return await _claim_explicit(RankClaim(bus, keys, role, rank, holder_token(),
                                               hb.timeout_s), hb, say)
    except RankHeld as exc:
        raise RankTaken(str(exc)) from None


async def _claim_explicit(claim: RankClaim, hb: HeartbeatConfig,
                          say: Callable[[str], None]) -> RankClaim:
    """``claim`` taken, from a dead holder if need be (see the module docstring)."""
    deadline = time.monotonic() + hb.timeout_s + 2 * hb.interval_s
    first: tuple[str, float, int] | None = None  # holder, when and TTL at the first look
    while True:
        holder = await claim.take()
        if holder is None:
            return claim
        if local_holder_gone(holder):
            if await claim.steal(holder):
                return claim
            continue
        ttl, now = await claim.remaining_ms(), time.monotonic()
        if ttl < 0:  # lapsed between SET NX and PTTL
            continue
        if first is None or first[0] != holder:
            first = (holder, now, ttl)
            say(f"rank {claim.rank} is held by {holder}; checking whether it is alive (its "
                f"claim {claim.key} lapses in {ttl / 1000:.1f} s unless extended)")
        elif ttl > first[2] - (now - first[1]) * 1000 + RENEWED_MARGIN_MS or now > deadline:
            raise RankHeld(claim.role, claim.rank, holder, claim.key)
        await asyncio.sleep(min(hb.interval_s / 2, max(ttl, 1) / 1000))
