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
    weights: tuple[tuple[int, BlobRef], ...] = ()
    checkpoints: tuple[tuple[int, str], ...] = ()
    trained: frozenset[str] = frozenset()
    steps: tuple[StepRecord, ...] = ()

    def checkpoint(self) -> tuple[int, str | None]:
        """The newest checkpoint of a *finished* step: ``(step, path)``, or ``(0, None)``.

        A checkpoint written for a step whose StepFinished never made it to the log (a crash
        in between) holds an update that did not happen, as far as the log is concerned.
        """
        done = [(step, path) for step, path in self.checkpoints if step <= self.last_step]
        return max(done) if done else (0, None)

    def steps_after_checkpoint(self) -> tuple[StepRecord, ...]:
        """Finished steps that the usable checkpoint does not hold yet (to re-apply)."""
        step, _ = self.checkpoint()
        return tuple(s for s in self.steps if s.step > step)

    def weights_of(self, version: int) -> BlobRef | None:
        """The last published weights of ``version`` (None if never published)."""
        refs = [ref for v, ref in self.weights if v == version]
        return refs[-1] if refs else None


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
        case WeightsPublished(version=version, ref=ref):
            return replace(state, weights=(*state.weights, (version, ref)))
        case CheckpointSaved(step=step, path=path):
            return replace(state, checkpoints=(*state.checkpoints, (step, path)))
        case RunFinished():
            return replace(state, finished=True)
    return state


def fold(events: Iterable[Message], state: TrainerState | None = None) -> TrainerState:
    """Fold a sequence of events (in log order) into a :class:`TrainerState`."""
    state = state or TrainerState()
    for event in events:
        state = apply(state, event)
    return state
