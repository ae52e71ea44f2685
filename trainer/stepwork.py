"""A step that trains while it gathers.

A step's groups are taken in arrival order, ``ppo_mini_batch_size`` prompts per mini-batch,
and each complete mini-batch goes to the trainer's worker thread at once
(:class:`trainer.update.GrpoStep`): its first-epoch optimizer step runs while the rollouters
are still answering the step's later tickets. That is the same computation as training on
the whole batch at the end (:func:`trainer.update.grpo_update`, what a resume replays), on one
condition (:func:`may_stream`): a *stale* mini-batch needs its proximal log-probs from the
weights the step started from, so optimizer steps begin only once no stale group can still
join the step.

The step core (trainer.core) decides which mini-batches go and when they may optimize
(:class:`~trainer.actions.Train`); :class:`StepWork` is the shell's side: the calls queued on
the worker and their futures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from runschema.messages import Sample
from trainer.actions import Train
from trainer.intake import Group
from trainer.ledger import OpenTicket

__all__ = ["StepCalls", "StepWork", "may_stream"]


def may_stream(ready: list[Group], missing: int, open_tickets: Mapping[int, OpenTicket],
               taken: set[int], version: int) -> bool:
    """Whether the step may run optimizer steps before all its groups are here: only when
    none of its ``missing`` groups can be stale (a stale mini-batch's proximal log-probs
    need the weights the step started from; trainer.update). Open tickets of an older
    version, or reissued ones (an earlier attempt may still answer), may be."""
    if any(g.possibly_stale(version) for g in ready[:missing]):
        return False
    if missing <= len(ready):
        return True
    return not any(t.version < version or t.attempt > 0
                   for i, t in open_tickets.items() if i not in taken)


class StepCalls(Protocol):
    """One step's training, call by call (:class:`trainer.update.GrpoStep`, or
    :class:`trainer.learner.RankedStep` on every rank)."""

    def add(self, groups: Sequence[Sequence[Sample]]) -> None: ...

    def train(self) -> None: ...

    def finish(self) -> dict[str, float]: ...


class StepWork:
    """One step's training on the worker thread: the queued calls (futures) of its step,
    with their compute time."""

    def __init__(self, submit: Callable[..., asyncio.Future[Any]], step: StepCalls) -> None:
        self._submit = submit
        self.step = step
        self.futures: list[asyncio.Future[Any]] = []
        self.busy_s = 0.0

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy_s += time.perf_counter() - t

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self.futures.append(self._submit(self._timed, fn, *args))

    def add(self, mini_batch: Train) -> None:
        """Queue a mini-batch, and its first-epoch optimizer step when the core says it
        may run now."""
        self.submit(self.step.add, mini_batch.groups)
        if mini_batch.optimize:
            self.submit(self.step.train)

    @property
    def running(self) -> bool:
        return any(not f.done() for f in self.futures)

    def raise_failures(self) -> None:
        """A failed mini-batch fails the step now, not at its end."""
        for f in self.futures:
            if f.done():
                f.result()

    async def finish(self) -> dict[str, float]:
        """The remaining epochs and the step's metrics."""
        self.submit(self.step.finish)
        results: list[Any] = await asyncio.gather(*self.futures)
        return results[-1]

    async def settle(self) -> None:
        """Never leave the worker's futures unawaited (their errors would be lost)."""
        await asyncio.gather(*self.futures, return_exceptions=True)
