"""Whether the run's trainer is there, judged from its fencing lease key.

The key's TTL is judged by Redis's clock, and the trainer renews it from a loop its updates
never block, so a long training step is not silence: only a key absent for
``heartbeat.timeout_s`` is. A trainer never seen and one that went away are told apart.
"""

from __future__ import annotations

from typing import Protocol

from bus import Bus
from runschema.messages import ComponentFailed
from runtime import Failure

__all__ = ["Presence", "TrainerGone", "TrainerPresence"]


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

    async def check(self) -> None:
        """Raise :class:`TrainerGone` once the lease key has been absent for longer than
        the timeout (Redis ``EXISTS``)."""
        exists = await self.bus.exists(self.lease_key)
        # After the read, on the clock that stops while Redis is silent: a lease that lapsed
        # during an outage (nobody could renew it) is judged by the time since Redis answered.
        now = self.bus.reach_clock()
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
        return await self.bus.write_refusal()
