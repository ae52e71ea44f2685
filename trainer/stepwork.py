"""A step that trains while it gathers.

A step's groups are taken in arrival order, ``ppo_mini_batch_size`` prompts per mini-batch,
and each complete mini-batch goes to the trainer's worker thread at once
(:class:`trainer.update.GrpoStep`): its first-epoch optimizer step runs while the rollouters
are still answering the step's later tickets. That is the same computation as training on
the whole batch at the end (:func:`trainer.update.grpo_update`, what a resume replays), on one
condition (:func:`may_stream`): a *stale* mini-batch needs its proximal log-probs from the
weights the step started from, so optimizer steps begin only once no stale group can still
join the step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from trainer.intake import Group
from trainer.ledger import OpenTicket
from trainer.update import GrpoStep

__all__ = ["StepWork", "may_stream"]


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


class StepWork:
    """One step's training on the worker thread: the groups it took, in mini-batch order,
    and the queued calls (futures) of its GrpoStep, with their compute time."""

    def __init__(self, submit: Callable[..., asyncio.Future[Any]], step: GrpoStep) -> None:
        self._submit = submit
        self.step = step
        self.taken: list[Group] = []
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

    def feed(self, ready: list[Group], need: int, mini_batch: int,
             may_stream_now: Callable[[int], bool]) -> None:
        """Take each complete mini-batch of ``ready`` groups (removed from it) up to ``need``
        groups; let its first-epoch optimizer step run now when no stale group can still
        join the step (``may_stream_now(missing)``)."""
        while len(self.taken) < need and len(ready) >= mini_batch:
            chunk = ready[:mini_batch]
            del ready[:mini_batch]
            self.taken.extend(chunk)
            self.submit(self.step.add, [[s for _, s in g.ordered()] for g in chunk])
            if may_stream_now(need - len(self.taken)):
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
