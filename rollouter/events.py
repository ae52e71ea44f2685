"""What a rollouter reads from the run's log, folded: the weights published, the trainer's
step boundaries (this replica's profiling steps), validation answers and the run's end.

One reader of the log (the trainer's facts and the replicas' validation answers) serves the
rollout loop and the step watcher alike (:class:`runtime.LogFollower`: a read that starts
after a call began sees everything written before that call).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from bus import Entry
from profiling.driver import StepProfiler
from rollouter.stepwatch import StepWatch
from runschema.facts import run_finished_refusal
from runschema.messages import (
    Message,
    RunFinished,
    RunStarted,
    ValidationFinished,
    WeightsPublished,
)

__all__ = ["EventLog", "EventPoller"]


class EventLog(Protocol):
    """The run's log as a rollouter reads it: :class:`runtime.LogFollower` over the trainer's
    and the rollouters' streams, or a scripted one in tests."""

    @property
    def caught_up(self) -> bool:
        """The last read reached the end of the log."""
        ...

    @property
    def position(self) -> str:
        """Where the reader stands in the trainer's stream."""
        ...

    async def poll(self, block_ms: int | None = None) -> list[Entry]:
        """One read after the position (``block_ms``: wait at most that long for something
        new); the new entries, in log order, each once."""
        ...


class EventPoller:
    """The log as this replica has read it. ``log``: where it reads; ``saw_weights``: each
    WeightsPublished, in log order (:meth:`rollouter.weights.HeldWeights.saw`);
    ``total_steps``: the run's steps (a RunFinished with fewer is not the end);
    ``profiler``: this replica's profiler agent once built (None: profiling off), whose
    steps follow the trainer's (``commands``, ``publish``: :class:`StepWatch`);
    ``complain``: a line about an entry of ``stream`` (the trainer's) passed over."""

    def __init__(self, log: EventLog, *, saw_weights: Callable[[WeightsPublished], None],
                 total_steps: int, profiler: Callable[[], StepProfiler | None],
                 commands: Callable[[], Awaitable[None]],
                 publish: Callable[..., Awaitable[None]],
                 complain: Callable[[str], None], stream: str) -> None:
        self.log, self.stream = log, stream
        self.saw_weights, self.total_steps = saw_weights, total_steps
        self.profiler, self.complain = profiler, complain
        self.finished = False
        """The trainer finished the run (a RunFinished of all its steps)."""
        self.validated: set[str] = set()
        """The validation requests answered in the log (by any replica)."""
        # The trainer's step boundaries read from the log: this rollouter's profiling steps.
        self.steps = StepWatch(total_steps, commands=commands, publish=publish,
                               poll=self.poll)

    @property
    def position(self) -> str:
        """Where this replica is in the trainer's events stream (stored at every pulse, so
        that the trainer's events trim never removes what it has yet to read)."""
        return self.log.position

    async def poll(self, block_ms: int | None = None) -> bool:
        """Read new run events (a read that starts now: it sees everything written before
        this call). Once it has read the whole log, this rollouter's profiling steps follow
        the trainer's. Returns whether it has read the whole log."""
        # Folded before this coroutine yields again: the read that moved the position folds
        # its entries, whichever task reads next.
        self.fold(await self.log.poll(block_ms=block_ms))
        caught_up = self.log.caught_up
        if caught_up:  # this rollouter's profiling steps follow the trainer's
            await self.steps.follow(self.profiler())
        return caught_up

    def fold(self, entries: Sequence[Entry]) -> None:
        """Every events entry once, in log order: weights (the newest in log order wins:
        after a resume from a log that lost its tail, a lower version is the current one),
        the trainer's step boundaries, validation answers and the run's end."""
        for entry_id, msg in entries:
            last_step = self.steps.finished
            self.steps.observe(msg)
            self._fold_one(entry_id, msg, last_step)

    def _fold_one(self, entry_id: str, msg: Message, last_step: int) -> None:
        match msg:
            case WeightsPublished():
                self.saw_weights(msg)
            case RunStarted():
                self.finished = False
            case ValidationFinished():
                self.validated.add(msg.request_id)
            case RunFinished():
                why = run_finished_refusal(msg, last_step)
                if why is not None:  # not the trainer's: the run goes on
                    self.complain(f"ignored {entry_id} of {self.stream}: {why}")
                # A run extended with more steps than it finished with goes on; one that
                # only validated has no steps to go on with.
                elif msg.validation_only or msg.steps >= self.total_steps:
                    self.finished = True

    async def stop(self) -> None:
        """End the step watcher's background reader (between two moves)."""
        await self.steps.stop()
