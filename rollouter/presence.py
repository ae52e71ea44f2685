"""Whether the run's trainer is there, judged from its fencing lease key.

The key's TTL is judged by Redis's clock, and the trainer renews it from a loop its updates
never block, so a long training step is not silence: only a key absent for
``heartbeat.timeout_s`` is. A trainer never seen and one that went away are told apart.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from bus import Bus
from runschema.messages import ComponentFailed
from runtime import Failure

__all__ = ["Presence", "TrainerGone", "TrainerPresence"]

REFUSALS_EVERY_S = 30.0
REFUSALS_KEPT = 10
"""About five minutes of counts: the line names refusals of that window, not of the server's
lifetime (an episode an hour ago, since mended, is not why the trainer went now)."""


class Presence(Protocol):
    """The trainer's presence as a rollout loop checks it: :class:`TrainerPresence`, or an
    in-memory one in tests."""

    async def check(self) -> None:
        """Raise :class:`TrainerGone` once the trainer has been absent for too long."""
        ...


class TrainerGone(Failure):
    """The trainer never appeared or went silent; the message says which and for how long."""


class TrainerPresence:
    """The trainer lease ``lease_key`` of run ``run_id``, watched by a rollouter."""

    def __init__(self, bus: Bus, lease_key: str, run_id: str, timeout_s: float,
                 trainer_log: str | None = None) -> None:
        self.bus = bus
        self.lease_key = lease_key
        self.trainer_log = trainer_log
        """The trainer's log stream: a trainer that failed said why there last."""
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.absent_since: float | None = bus.reach_clock()  # judged from construction on
        self.seen = False
        self.memory_refusals: deque[tuple[float, int]] = deque(maxlen=REFUSALS_KEPT)
        """(clock, Redis's count of writes refused for memory), read every
        ``REFUSALS_EVERY_S`` from the first check on: a trainer that went silent because
        Redis refused its writes could not say so, and a count that grew says it for it."""

    async def check(self) -> None:
        """Raise :class:`TrainerGone` once the lease key has been absent for longer than
        the timeout (Redis ``EXISTS``)."""
        exists = await self.bus.exists(self.lease_key)
        # After the read, on the clock that stops while Redis is silent: a lease that lapsed
        # during an outage (nobody could renew it) is judged by the time since Redis answered.
        now = self.bus.reach_clock()
        await self._count_refusals(now)  # from the first check on: before the trainer too
        if exists:
            self.absent_since = None
            self.seen = True
            return
        if self.absent_since is None:
            self.absent_since = now
        waited = now - self.absent_since
        if waited <= self.timeout_s:
            return
        if not self.seen:
            raise TrainerGone(
                f"no trainer: no trainer lease ({self.lease_key}) for run {self.run_id!r} in "
                f"{waited:.0f} s (heartbeat.timeout_s={self.timeout_s}); is the trainer "
                "running?")
        cause = await self._cause()
        raise TrainerGone(
            f"trainer is gone: {cause + '; ' if cause else ''}its lease {self.lease_key} "
            f"lapsed and stayed absent for {waited:.0f} s "
            f"(heartbeat.timeout_s={self.timeout_s})")

    async def _cause(self) -> str | None:
        """Why the trainer went, as it stated it (its last entry a ComponentFailed), or, when
        it could not state it, why Redis refuses every write (out of memory, unable to
        persist): the trainer's cause, repeated rather than "lease lapsed"."""
        if self.trainer_log is not None:
            last = await self.bus.latest(self.trainer_log)
            if last is not None and isinstance(last.msg, ComponentFailed):
                return f"it failed: {last.msg.error}"
        if not self.memory_refusals:
            return await self.bus.write_refusal()
        read_at, count = self.memory_refusals[0]
        return await self.bus.write_refusal(
            count, f"in the last {self.bus.reach_clock() - read_at:.0f} s")

    async def _count_refusals(self, now: float) -> None:
        if self.memory_refusals and now - self.memory_refusals[-1][0] < REFUSALS_EVERY_S:
            return
        count = await self.bus.memory_refusals()
        if count is not None:
            self.memory_refusals.append((now, count))
