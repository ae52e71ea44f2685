"""The trainer's state, folded from the run's events log: ``state = fold(events)``.

Pure: no Redis, no torch. A restarted trainer folds the log it reads back and resumes from
the result (last finished step, weights version, which sample ids are already trained).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from bus.messages import (
    BlobRef,
    CheckpointSaved,
    Message,
    RunFinished,
    RunStarted,
    StepFinished,
    WeightsPublished,
)

__all__ = ["StepRecord", "TrainerState", "apply", "fold"]


class StepRecord(msgspec.Struct, frozen=True):
    """What a finished step trained, in training order (for replay after a checkpoint)."""

    step: int
    sample_ids: tuple[str, ...]
    param_version: int


class TrainerState(msgspec.Struct, frozen=True):
    """Everything the trainer must know to resume; every field derives from events."""

    started: bool = False
    finished: bool = False
    last_step: int = 0
    param_version: int = -1
    weights: BlobRef | None = None
    checkpoint_step: int = 0
    checkpoint_path: str | None = None
    trained: frozenset[str] = frozenset()
    steps: tuple[StepRecord, ...] = ()

    def steps_after_checkpoint(self) -> tuple[StepRecord, ...]:
        """Finished steps that the latest checkpoint does not hold yet (to re-apply)."""
        return tuple(s for s in self.steps if s.step > self.checkpoint_step)


def apply(state: TrainerState, msg: Message) -> TrainerState:
    """Fold one event into the state; events that do not concern the trainer are ignored."""
    replace = msgspec.structs.replace
    match msg:
        case RunStarted():
            return replace(state, started=True, finished=False)
        case StepFinished(step=step, sample_ids=ids, param_version=version):
            if step <= state.last_step:  # a duplicate event (at-least-once write) changes nothing
                return state
            record = StepRecord(step, tuple(ids), version)
            return replace(
                state,
                last_step=step,
                trained=state.trained | frozenset(ids),
                steps=(*state.steps, record),
            )
        case WeightsPublished(version=version, ref=ref) if version > state.param_version:
            return replace(state, param_version=version, weights=ref)
        case CheckpointSaved(step=step, path=path) if step >= state.checkpoint_step:
            return replace(state, checkpoint_step=step, checkpoint_path=path)
        case RunFinished():
            return replace(state, finished=True)
    return state


def fold(events: Iterable[Message], state: TrainerState | None = None) -> TrainerState:
    """Fold a sequence of events (in log order) into a :class:`TrainerState`."""
    state = state or TrainerState()
    for event in events:
        state = apply(state, event)
    return state
