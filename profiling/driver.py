"""The profiling glue the trainer and the rollouter share: their agent, driven at step
boundaries on the component's worker thread.

:class:`StepProfiler` wraps a :class:`~profiling.agent.ProfilerAgent`: commands read from the
control stream go in (:meth:`~StepProfiler.on_commands`), step boundaries are applied on the
worker thread (torch.profiler records the thread it was started on, the one that runs the
steps), and every call returns the events the component publishes (ProfileStarted,
ProfileStopped, WarningRaised). The component owns reading the control stream and publishing
(:class:`runtime.Component`); the rollouter's step clock, which says when its steps begin and
end, is :mod:`profiling.steps`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from profiling.steps import Move

if TYPE_CHECKING:  # the agent's module imports torch; this one stays light
    from profiling.export import AgentEvent
    from runschema.messages import Command

__all__ = ["Agent", "RunOff", "StepProfiler"]

T = TypeVar("T")


class Agent(Protocol):
    """What a component drives at its step boundaries: a
    :class:`~profiling.agent.ProfilerAgent`, or what stands in for one
    (``trainer.rankprofile.RankedAgent`` relays every call to the trainer's other ranks).
    ``on_command`` takes any thread; the step calls and ``close`` the thread that runs the
    steps. Every call returns the events the component publishes."""

    def on_command(self, cmd: Command) -> list[AgentEvent]: ...

    def drain(self) -> list[AgentEvent]: ...

    def step_begin(self, step: int) -> list[AgentEvent]: ...

    def step_end(self, step: int) -> list[AgentEvent]: ...

    def close(self) -> list[AgentEvent]: ...


class RunOff(Protocol):
    """Runs ``fn()`` on the component's worker thread (:meth:`runtime.Component.off`)."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...


class StepProfiler:
    """``agent`` driven through ``run_off`` (runs a call on the component's worker thread)."""

    def __init__(self, agent: Agent, run_off: RunOff) -> None:
        self.agent = agent
        self._off = run_off

    def on_commands(self, commands: Sequence[Command]) -> list[AgentEvent]:
        """Arm or cancel sessions (no torch: any thread); the events to publish."""
        events: list[AgentEvent] = []
        for cmd in commands:
            events += self.agent.on_command(cmd)
        return events

    async def begin(self, step: int) -> list[AgentEvent]:
        """``step`` begins (sessions armed for it start)."""
        return await self._off(lambda: self.agent.step_begin(step))

    async def end(self, step: int) -> list[AgentEvent]:
        """``step`` ended (a session whose last step it was stops; its trace is written
        beside the next step and its ProfileStopped comes from a later call)."""
        return await self._off(lambda: self.agent.step_end(step))

    async def moves(self, moves: Sequence[Move]) -> list[AgentEvent]:
        """Several boundaries in order, in one hop to the worker thread."""
        agent = self.agent

        def run() -> list[AgentEvent]:
            events: list[AgentEvent] = []
            for kind, step in moves:
                events += agent.step_begin(step) if kind == "begin" else agent.step_end(step)
            return events

        return await self._off(run)

    def exported(self) -> list[AgentEvent]:
        """Events of traces written beside the steps since the last call (no worker hop: a
        session's ProfileStopped goes out at the next pulse, not only at the next step)."""
        return self.agent.drain()

    async def close(self) -> list[AgentEvent]:
        """The component stops: end every session and wait for every trace."""
        return await self._off(self.agent.close)
