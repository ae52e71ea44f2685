"""Profiling every trainer rank: rank 0's agent relays each step boundary to the others.

Only rank 0 reads the control stream and publishes. :class:`RankedAgent` stands in for its
:class:`~profiling.agent.ProfilerAgent` (the same calls, :class:`profiling.driver.StepProfiler`
drives it): the commands it takes are queued and sent with the next step boundary over the
ranks' op channel (trainer.learner), every rank's agent applies them and crosses the same
boundary, and the events every rank's agent returns (ProfileStarted, ProfileStopped,
warnings) come back to rank 0, which publishes them. Each rank writes its own trace
(``trainer{rank}-SESSION.json.gz``, ``distributedInfo.rank`` = its rank) into the run's
profile folder and the session folder; the profiler service expects one per trainer rank.
A rank's ProfileStopped reaches rank 0 at the boundary after its trace is written.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.learner import Learner

__all__ = ["RankedAgent", "follow_profile"]


class RankedAgent:
    """Rank 0's agent and, through ``learner``'s op channel, every other rank's."""

    def __init__(self, agent: Any, learner: Learner) -> None:
        self.agent = agent
        self.learner = learner
        self._lock = threading.Lock()
        self._commands: list[Any] = []  # taken since the last boundary, for the other ranks

    def on_command(self, cmd: Any) -> list[Any]:
        """Any thread: rank 0's agent takes it now, the others at the next boundary."""
        with self._lock:
            self._commands.append(cmd)
        result: list[Any] = self.agent.on_command(cmd)
        return result

    def drain(self) -> list[Any]:
        """Rank 0's written traces (the other ranks' come with the next boundary)."""
        result: list[Any] = self.agent.drain()
        return result

    def step_begin(self, step: int) -> list[Any]:
        return self._relay("step_begin", step)

    def step_end(self, step: int) -> list[Any]:
        return self._relay("step_end", step)

    def close(self) -> list[Any]:
        return self._relay("close")

    def _relay(self, method: str, *args: Any) -> list[Any]:
        """The worker thread: every rank crosses the boundary; all their events."""
        with self._lock:
            commands, self._commands = self._commands, []
        self.learner.relay_profile(method, args, commands)
        events: list[Any] = getattr(self.agent, method)(*args)
        for theirs in self.learner.group.gather([])[1:]:
            events += theirs
        return events


def follow_profile(agent: Any, learner: Learner, payload: tuple[str, tuple[Any, ...],
                                                                list[Any]]) -> None:
    """A rank > 0: the commands rank 0 took, the boundary, and this rank's events back to
    rank 0 (its agent is None when profiling is off: nothing but the gather)."""
    method, args, commands = payload
    events: list[Any] = []
    if agent is not None:
        for cmd in commands:
            events += agent.on_command(cmd)
        events += getattr(agent, method)(*args)
        events += agent.drain()
    learner.group.gather(events)
