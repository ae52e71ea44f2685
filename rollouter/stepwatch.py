"""A rollouter's profiling steps, following the trainer's step boundaries in the log.

The trainer's ``StepStarted`` / ``StepFinished`` events are folded into a
:class:`~profiling.steps.StepClock` (:meth:`StepWatch.observe`, from the log follower's
fold); :meth:`StepWatch.follow` then brings the profiler agent to the trainer's step: it
ends the step the agent was in and begins each step since, in order, after reading the
profiling commands (a step never begins before the commands for it). With an agent, a
background task keeps reading the log (a blocking read), so a rollouter that waits for
tickets moves its steps at once; a busy one's moves queue on its worker thread behind the
current generation batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from profiling.driver import StepProfiler
from profiling.steps import StepClock, follow, observe

__all__ = ["StepWatch"]


class StepWatch:
    """The trainer's steps as this rollouter has read them, and its agent's moves.

    ``commands``: read the new profiling commands into the agent; ``publish``: publish the
    agent's events; ``poll``: one blocking read of the log (``block_ms``), whose fold calls
    :meth:`observe` and then :meth:`follow`."""

    def __init__(self, total_steps: int, *, commands: Callable[[], Awaitable[None]],
                 publish: Callable[..., Awaitable[None]],
                 poll: Callable[[int], Awaitable[Any]]) -> None:
        self.total_steps = total_steps
        self.clock = StepClock()
        self._commands, self._publish, self._poll = commands, publish, poll
        self._lock = asyncio.Lock()  # one move of the agent's steps at a time, in order
        self._task: asyncio.Task[None] | None = None  # _watch, with an agent only

    @property
    def finished(self) -> int:
        """The last step the trainer finished, as read so far."""
        return self.clock.finished

    def observe(self, msg: Any) -> None:
        """Fold one event of the log (in log order)."""
        self.clock = observe(self.clock, msg)

    async def follow(self, profiler: StepProfiler | None) -> None:
        """Bring ``profiler`` to the trainer's current step (without one, just the clock)."""
        if profiler is None:
            self.clock, _ = follow(self.clock, self.total_steps)
            return
        if self._task is None:
            self._task = asyncio.create_task(self._watch())
        async with self._lock:
            self.clock, moves = follow(self.clock, self.total_steps)
            if not moves:
                return
            if any(kind == "begin" for kind, _ in moves):
                await self._commands()
            await self._publish(*(await profiler.moves(moves)))

    async def _watch(self) -> None:
        """Background: read the log as it is written (each read's fold follows the steps)."""
        while True:
            await self._poll(1000)

    async def stop(self) -> None:
        """End the background reader between two moves (a move cut short would lose its
        events)."""
        task, self._task = self._task, None
        if task is None:
            return
        async with self._lock:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
