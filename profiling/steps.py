"""Which trainer step a rollouter is in, folded from the run's events log (pure, torch-free).

One step unit for profiling on every role: the trainer's update number (what
``StepStarted``/``StepFinished`` carry, what ``rlbus up`` shows and what a StartProfile's
``first_step``/``last_step`` name), whatever ``trigger_parameter_sync_step`` is.
(``global_profiler.steps`` counts verl's steps, parameter versions; the profiler service turns
each into its updates before any command goes out: :mod:`runconfig.stepunit`.) The trainer's
step ``K`` runs from ``StepStarted(K)`` to ``StepFinished(K)``. A rollouter's step ``K`` is the
same stretch of the run as the rollouter sees it:

* it **begins** when the rollouter reads ``StepFinished(K-1)``; step 1 (and the first step
  of a resumed trainer) when it reads the trainer's first ``WeightsPublished``. The trainer
  writes both only after it raised the step barrier to ``K`` (docs/profiling.md), so every
  command for step ``K`` is already in the control stream when the rollouter reads it next;
  and it writes them *before* the prompt tickets it issues next, so the generation those
  tickets cause always falls in the rollouter's step ``K``;
* it **ends** when the rollouter reads ``StepFinished(K)`` (then step ``K+1`` begins at once,
  unless ``K`` is the run's last step).

The rollouter's windows therefore tile the run from weights version 0 to the last
``StepFinished``: window ``K`` is ``[StepFinished(K-1), StepFinished(K)]``, trainer step ``K``
plus the few milliseconds of bookkeeping between ``StepFinished(K-1)`` and ``StepStarted(K)``,
both ends late by the time the rollouter takes to act on the event: its profiler calls run on
the thread that generates, between generation batches (or partial-rollout chunks).

A rollouter that read several boundaries at once (it was busy for more than a step) walks
through each step in between, so every step is begun and ended exactly once, in order, and a
session's annotations are all in its trace. A process that first reads the log after the
trainer's first weights (a late replica, a restart) begins with the step in progress: the
steps before it were not its own.

:func:`observe` folds one event into a :class:`StepClock`; :func:`follow` says which
``("begin" | "end", step)`` calls the rollouter makes on its profiler agent now. Both are
pure functions (tests/test_rollouter_steps.py checks them with hypothesis).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from runschema.messages import StepFinished, StepStarted, WeightsPublished

__all__ = ["Move", "StepClock", "current_step", "follow", "observe"]

Move = tuple[Literal["begin", "end"], int]
"""One call on the profiler agent: ``("begin", K)`` = ``step_begin(K)``, ``("end", K)`` =
``step_end(K)``."""


class StepClock(msgspec.Struct, frozen=True, kw_only=True):
    """The trainer's step boundaries a rollouter has read, and the steps it has begun."""

    weights: bool = False
    """A WeightsPublished was read: the trainer has let its first step begin."""
    finished: int = 0
    """Highest StepFinished read."""
    started: int = 0
    """Highest StepStarted read (a boundary is never later than it)."""
    begun: int = 0
    """Last step this rollouter began (0: none yet)."""
    open: bool = False
    """Step ``begun`` is still open (begun, not ended)."""
    from_start: bool = False
    """This process followed the log before the first WeightsPublished: it has been there
    since step 1 (a process that reads the log for the first time later joined late)."""


def observe(clock: StepClock, msg: object) -> StepClock:
    """``clock`` after one more events entry; other entries return ``clock`` itself."""
    match msg:
        case WeightsPublished() if not clock.weights:
            return msgspec.structs.replace(clock, weights=True)
        case StepFinished(step=step) if step > clock.finished:
            return msgspec.structs.replace(clock, finished=step)
        case StepStarted(step=step) if step > clock.started:
            return msgspec.structs.replace(clock, started=step)
    return clock


def current_step(clock: StepClock, total: int) -> int:
    """The step the trainer has let begin and not yet finished, by what was read; 0 when
    there is none (before the first weights, or past the run's last step ``total``)."""
    if not clock.weights:
        return 0
    step = max(clock.finished + 1, clock.started)
    return step if step <= total else 0


def follow(clock: StepClock, total: int) -> tuple[StepClock, list[Move]]:
    """The agent calls that bring the rollouter to :func:`current_step`, in order, and the
    clock after them. Steps only go forward: every step from the rollouter's first one on
    is begun once and ended once (the one in progress stays open)."""
    if not clock.weights:
        if clock.from_start:
            return clock, []
        return msgspec.structs.replace(clock, from_start=True), []
    target = current_step(clock, total)
    begun, open_ = clock.begun, clock.open
    if begun or clock.from_start:
        # Every step since the last one begun, up to the one in progress (all of them
        # once the run is past its last step).
        last = target if target else min(clock.finished, total)
        steps = range(begun + 1, last + 1)
    else:
        # A late joiner's first window: the step in progress, if any.
        steps = range(target, target + 1) if target else range(0)
    moves: list[Move] = []
    for step in steps:
        if open_:
            moves.append(("end", begun))
        moves.append(("begin", step))
        begun, open_ = step, True
    if open_ and not target:
        moves.append(("end", begun))
        open_ = False
    if not moves:
        return clock, moves
    return msgspec.structs.replace(clock, begun=begun, open=open_), moves
