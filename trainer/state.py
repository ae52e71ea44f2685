"""The trainer's state, folded from the run's events log: ``state = fold(events)``.

Pure: no Redis, no torch. A restarted trainer folds the log it reads back and resumes from
the result (last finished step, weights version, open tickets, the steps to re-apply).
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
from trainer.ledger import Ledger
from trainer.ledger import apply as ledger_apply

__all__ = ["KEEP_WEIGHT_EVENTS", "StepRecord", "TrainerState", "apply", "fold"]


class StepRecord(msgspec.Struct, frozen=True):
    """What a finished step trained, in training order (for replay after a checkpoint)."""

    step: int
    sample_ids: tuple[str, ...]
    param_version: int
    entry_ids: tuple[str, ...] = ()


class TrainerState(msgspec.Struct, frozen=True):
    """Everything the trainer must know to resume; every field derives from events.

    Bounded whatever the run's length: ``steps`` holds only the finished steps after the
    newest usable checkpoint (those a resume re-applies), ``weights`` only the newest
    publications, and the ticket ledger only open tickets.
    """

    started: bool = False
    finished: bool = False
    last_step: int = 0
    total_steps: int = 0
    weights: tuple[tuple[int, BlobRef], ...] = ()
    checkpoint_at: tuple[int, str] | None = None
    """The newest checkpoint of a *finished* step: ``(step, path)``."""
    unfinished_checkpoints: tuple[tuple[int, str], ...] = ()
    """Checkpoints whose step has no StepFinished in the log yet."""
    steps: tuple[StepRecord, ...] = ()
    ledger: Ledger = Ledger()

    def checkpoint(self) -> tuple[int, str | None]:
        """The newest checkpoint of a *finished* step: ``(step, path)``, or ``(0, None)``.

        A checkpoint written for a step whose StepFinished never made it to the log (a crash
        in between) holds an update that did not happen, as far as the log is concerned.
        """
        return self.checkpoint_at if self.checkpoint_at is not None else (0, None)

    def steps_after_checkpoint(self) -> tuple[StepRecord, ...]:
        """Finished steps that the usable checkpoint does not hold yet (to re-apply)."""
        step, _ = self.checkpoint()
        return tuple(s for s in self.steps if s.step > step)

    def weights_of(self, version: int) -> BlobRef | None:
        """The last published weights of ``version`` (None if never published or too old)."""
        refs = [ref for v, ref in self.weights if v == version]
        return refs[-1] if refs else None


KEEP_WEIGHT_EVENTS = 8  # newest WeightsPublished kept in the state (blob clean-up, hash check)


def _promote(state: TrainerState) -> TrainerState:
    """Make the newest checkpoint of a finished step the usable one; drop the step records
    it makes unnecessary."""
    ready = [c for c in state.unfinished_checkpoints if c[0] <= state.last_step]
    if not ready:
        return state
    best = max(ready)
    if state.checkpoint_at is not None and state.checkpoint_at[0] >= best[0]:
        best = state.checkpoint_at
    return msgspec.structs.replace(
        state,
        checkpoint_at=best,
        unfinished_checkpoints=tuple(
            c for c in state.unfinished_checkpoints if c[0] > state.last_step
        ),
        steps=tuple(s for s in state.steps if s.step > best[0]),
    )


def apply(state: TrainerState, msg: Message) -> TrainerState:
    """Fold one event into the state; events that do not concern the trainer are ignored."""
    replace = msgspec.structs.replace
    ledger = ledger_apply(state.ledger, msg)
    if ledger is not state.ledger:
        state = replace(state, ledger=ledger)
    match msg:
        case RunStarted(config=config):
            trainer_cfg = config.get("trainer", {}) if isinstance(config, dict) else {}
            total = trainer_cfg.get("total_training_steps", 0) if isinstance(
                trainer_cfg, dict) else 0
            return replace(state, started=True, finished=False,
                           total_steps=total if isinstance(total, int) else 0)
        case StepFinished(step=step, sample_ids=ids, param_version=version, entry_ids=entry_ids):
            if step <= state.last_step:  # a duplicate event (at-least-once write) changes nothing
                return state
            record = StepRecord(step, tuple(ids), version, tuple(entry_ids))
            return _promote(replace(state, last_step=step, steps=(*state.steps, record)))
        case WeightsPublished(version=version, ref=ref):
            kept = (*state.weights, (version, ref))[-KEEP_WEIGHT_EVENTS:]
            return replace(state, weights=kept)
        case CheckpointSaved(step=step, path=path):
            pending = (*state.unfinished_checkpoints, (step, path))
            return _promote(replace(state, unfinished_checkpoints=pending))
        case RunFinished():
            return replace(state, finished=True)
    return state


def fold(events: Iterable[Message], state: TrainerState | None = None) -> TrainerState:
    """Fold a sequence of events (in log order) into a :class:`TrainerState`."""
    state = state or TrainerState()
    for event in events:
        state = apply(state, event)
    return state
