"""Ranks of a role's replicas, claimed on the bus: a process joins a running run without
knowing how many replicas there are, and two processes never hold one rank.

A rank is a string key ``RunKeys.rank_claim(role, k)`` (``rlbus:{RUN}:rank:ROLE:K``, in the
run's slot) whose value names its holder, ``PID@HOST/NONCE``, with a TTL: the heartbeat
timeout that liveness uses (:mod:`bus.liveness`), so a rank whose holder went silent for as
long as a dead peer takes to be noticed is free again, by Redis's clock alone. The holder
refreshes it with its heartbeat; only the holder can extend or delete it (the compare-and-
extend and compare-and-delete scripts of :class:`bus.liveness.Lease`).

    ``claim_rank(bus, keys, role, rank, ttl_s) -> RankClaim``
        SET NX PX (+ GET); a rank held by another process raises :class:`RankHeld`
    ``claim_lowest_rank(bus, keys, role, ttl_s, limit=MAX_RANKS) -> RankClaim``
        SET NX PX on rank 0, 1, ... until one is free
    ``RankClaim.refresh() -> bool``   compare-and-PEXPIRE (EVAL); re-SET NX if it lapsed
        unclaimed; False when another process holds it now (lost)
    ``RankClaim.release()``           compare-and-DEL (EVAL)
    ``RankClaim.holder() -> str | None``   GET
    ``RankClaim.steal(holder) -> bool``    compare-and-SET (EVAL), for a holder known dead
    ``RankClaim.remaining_ms() -> int``    PTTL
"""

from __future__ import annotations

import os
import secrets
import socket

from bus.errors import BusError
from bus.keys import RunKeys
from bus.liveness import Lease
from bus.streams import Bus

__all__ = ["MAX_RANKS", "RankClaim", "RankHeld", "RankLost", "claim_lowest_rank",
           "claim_rank", "holder_pid_host", "holder_token"]

MAX_RANKS = 1024
"""The highest rank :func:`claim_lowest_rank` tries, plus one: a bound on its loop (a run
with that many replicas of one role is not one we were built for)."""


class RankHeld(BusError):
    """Rank ``rank`` of ``role`` is held by another live process (``holder``)."""

    def __init__(self, role: str, rank: int, holder: str, key: str) -> None:
        super().__init__(f"{role} rank {rank} is already held by {holder} (key {key}): "
                         "each process needs its own rank (leave rollout.rank unset to get "
                         "the lowest free one)")
        self.role, self.rank, self.holder, self.key = role, rank, holder, key


class RankLost(BusError):
    """Our claim on a rank lapsed and another process took it."""

    def __init__(self, role: str, rank: int, holder: str | None, key: str) -> None:
        super().__init__(f"lost {role} rank {rank} to {holder or 'nobody'} (key {key}): this "
                         "process was silent past the heartbeat timeout")
        self.role, self.rank, self.holder, self.key = role, rank, holder, key


def holder_token() -> str:
    """A name for this process that no other shares: ``PID@HOST/NONCE`` (the nonce tells
    apart two processes with one pid on two hosts with one name, or a reused pid)."""
    return f"{os.getpid()}@{socket.gethostname()}/{secrets.token_hex(4)}"


class RankClaim:
    """Rank ``rank`` of ``role``, held by ``token`` (see the module docstring)."""

    def __init__(self, bus: Bus, keys: RunKeys, role: str, rank: int, token: str,
                 ttl_s: float) -> None:
        self.role = role
        self.rank = rank
        self.key = keys.rank_claim(role, rank)
        self.lease = Lease(bus, self.key, token, ttl_s)

    @property
    def token(self) -> str:
        return self.lease.token

    async def take(self) -> str | None:
        """Take the rank if free: None on success, else its holder. Wraps SET NX PX + GET."""
        return await self.lease.acquire()

    async def refresh(self) -> bool:
        """Extend our claim by the TTL (at each heartbeat). A claim that lapsed with nobody
        taking it is taken again. False: another process holds the rank now. Wraps EVAL
        (GET + PEXPIRE), then SET NX PX + GET when the key is gone."""
        if await self.lease.renew():
            return True
        holder = await self.lease.acquire()
        return holder is None or holder == self.token

    async def check(self) -> None:
        """:meth:`refresh`, raising :class:`RankLost` (naming the new holder) when lost."""
        if not await self.refresh():
            raise RankLost(self.role, self.rank, await self.holder(), self.key)

    async def release(self) -> None:
        """Give the rank up if we still hold it. Wraps EVAL (GET + DEL)."""
        await self.lease.release()

    async def holder(self) -> str | None:
        """Who holds the rank now (None: free). Wraps GET."""
        return await self.lease.holder()

    async def steal(self, holder: str) -> bool:
        """Take the rank from ``holder`` (known dead), only if it still holds it. Wraps EVAL
        (GET + SET PX)."""
        return await self.lease.steal(holder)

    async def remaining_ms(self) -> int:
        """Milliseconds the claim has left, whoever holds it (-2: free). Wraps PTTL."""
        return await self.lease.remaining_ms()


def holder_pid_host(holder: str) -> tuple[int, str] | None:
    """``(pid, host)`` of a holder token ``PID@HOST/NONCE`` (None: not such a token)."""
    pid, at, rest = holder.partition("@")
    host, slash, _ = rest.rpartition("/")
    if not (at and slash and pid.isdigit()):
        return None
    return int(pid), host


async def claim_rank(bus: Bus, keys: RunKeys, role: str, rank: int, ttl_s: float,
                     token: str | None = None) -> RankClaim:
    """Claim rank ``rank`` of ``role`` for ``ttl_s`` seconds (refresh it to keep it).
    Raises :class:`RankHeld` when another process holds it. Wraps SET NX PX + GET."""
    claim = RankClaim(bus, keys, role, rank, token or holder_token(), ttl_s)
    holder = await claim.take()
    if holder is not None:
        raise RankHeld(role, rank, holder, claim.key)
    return claim


async def claim_lowest_rank(bus: Bus, keys: RunKeys, role: str, ttl_s: float,
                            token: str | None = None, limit: int = MAX_RANKS) -> RankClaim:
    """Claim the lowest rank of ``role`` that no process holds (0, 1, ...: one SET NX PX
    per rank held). Raises :class:`RankHeld` (for rank ``limit - 1``) when all ``limit`` are
    held."""
    token = token or holder_token()
    for rank in range(limit):
        claim = RankClaim(bus, keys, role, rank, token, ttl_s)
        holder = await claim.take()
        if holder is None:
            return claim
        last = holder
    raise RankHeld(role, limit - 1, last, keys.rank_claim(role, limit - 1))
