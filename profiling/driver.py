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
from typing import Any, TypeVar

from profiling.steps import Move

__all__ = ["StepProfiler"]

T = TypeVar("T")

RunOff = Callable[[Callable[[], T]], Awaitable[T]]


class StepProfiler:
    """``agent`` driven through ``run_off`` (runs a call on the component's worker thread)."""

    def __init__(self, agent: Any, run_off: RunOff[Any]) -> None:
        self.agent = agent
        self._off = run_off

    def on_commands(self, commands: Sequence[object]) -> list[Any]:
        """Arm or cancel sessions (no torch: any thread); the events to publish."""
        events: list[Any] = []
        for cmd in commands:
            events += self.agent.on_command(cmd)
        return events

    async def begin(self, step: int) -> list[Any]:
        """``step`` begins (sessions armed for it start)."""
        result: list[Any] = await self._off(lambda: self.agent.step_begin(step))
        return result

    async def end(self, step: int) -> list[Any]:
        """``step`` ended (a session whose last step it was stops; its trace is written
        beside the next step and its ProfileStopped comes from a later call)."""
        result: list[Any] = await self._off(lambda: self.agent.step_end(step))
        return result

    async def moves(self, moves: Sequence[Move]) -> list[Any]:
        """Several boundaries in order, in one hop to the worker thread."""
        agent = self.agent

        def run() -> list[Any]:
            events: list[Any] = []
            for kind, step in moves:
                events += agent.step_begin(step) if kind == "begin" else agent.step_end(step)
            return events

        result: list[Any] = await self._off(run)
        return result

    def exported(self) -> list[Any]:
        """Events of traces written beside the steps since the last call (no worker hop: a
        session's ProfileStopped goes out at the next pulse, not only at the next step)."""
        result: list[Any] = self.agent.drain()
        return result

    async def close(self) -> list[Any]:
        """The component stops: end every session and wait for every trace."""
        result: list[Any] = await self._off(self.agent.close)
        return result
