"""The trainer's state, folded from the run's events log: ``state = fold(events)``.

Pure: no Redis, no torch. A restarted trainer folds the log it reads back and resumes from
the result (last finished step, weights version, open tickets, the steps to re-apply).

Facts that contradict the state folded so far are refused, not folded (:func:`refusal`):
whoever wrote them, the trainer never would have. A StepFinished must be step ``last + 1``
(an earlier one is a copy of a write, passed over) training answers of open tickets
(trainer.ledger); a CheckpointSaved must be of the step being finished (the trainer saves
before it writes that step's StepFinished) and named ``step-K.pt`` for its step ``K``; a
RunFinished must say the last finished step (at least one, unless the run only validated:
``trainer.val_only``); a TicketsClosed may close only open tickets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import PurePath

import msgspec

from runschema.messages import (
    BlobRef,
    CheckpointSaved,
    FileDigest,
    Message,
    RunFinished,
    RunForked,
    RunStarted,
    StepFinished,
    WeightsPublished,
)
from trainer.ledger import Ledger
from trainer.ledger import apply as ledger_apply
from trainer.ledger import refusal as ledger_refusal

__all__ = ["KEEP_WEIGHT_EVENTS", "StepRecord", "TrainerState", "apply", "checkpoint_name",
           "fold", "refusal", "take"]


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
    earlier_checkpoints: tuple[tuple[int, str], ...] = ()
    """Older checkpoints of finished steps, oldest first (at most
    :data:`KEEP_EARLIER_CHECKPOINTS`): a resume falls back to them when the newest file is
    missing, re-applying the steps after them (kept in ``steps``)."""
    unfinished_checkpoints: tuple[tuple[int, str], ...] = ()
    """Checkpoints whose step has no StepFinished in the log yet."""
    steps: tuple[StepRecord, ...] = ()
    ledger: Ledger = Ledger()
    ranks: int = 0
    """How many trainer ranks the run's last RunStarted was trained with (0: unknown): a
    replay with another count sums floats in another order (trainer.resume)."""
    checkpoint_files: dict[str, dict[str, FileDigest]] = {}
    """The digests each kept checkpoint's CheckpointSaved recorded, by its path (a resume
    verifies the files before it loads one: trainer.integrity)."""
    counts: dict[str, float] = {}
    """The run's running counts in its last StepFinished (:data:`RUNNING_COUNTS`)."""
    forked_at: int | None = None
    """The step the run was forked at (``RunForked``: rlbus fork), None when it was not."""

    def checkpoint(self) -> tuple[int, str | None]:
        """The newest checkpoint of a *finished* step: ``(step, path)``, or ``(0, None)``.

        A checkpoint written for a step whose StepFinished never made it to the log (a crash
        in between) holds an update that did not happen, as far as the log is concerned.
        """
        return self.checkpoint_at if self.checkpoint_at is not None else (0, None)

    def checkpoints(self) -> list[tuple[int, str]]:
        """The checkpoints of finished steps a resume may load, newest first."""
        newest = [] if self.checkpoint_at is None else [self.checkpoint_at]
        return newest + list(reversed(self.earlier_checkpoints))

    def files_of(self, path: str) -> dict[str, FileDigest]:
        """The digests recorded for the checkpoint at ``path`` (empty: none recorded)."""
        return self.checkpoint_files.get(path, {})

    def entries_of(self, step: int) -> tuple[str, ...]:
        """The sample entry ids step ``step`` trained, when its record is kept (empty: not
        kept, or written before entry ids were recorded)."""
        return next((s.entry_ids for s in self.steps if s.step == step), ())

    def steps_after_checkpoint(self, step: int | None = None) -> tuple[StepRecord, ...]:
        """Finished steps that the checkpoint of ``step`` (default: the usable one) does not
        hold yet (to re-apply)."""
        if step is None:
            step, _ = self.checkpoint()
        return tuple(s for s in self.steps if s.step > step)

    def weights_of(self, version: int) -> BlobRef | None:
        """The last published weights of ``version`` (None if never published or too old)."""
        refs = [ref for v, ref in self.weights if v == version]
        return refs[-1] if refs else None


RUNNING_COUNTS = ("fully_async/count/stale_samples_processed",
                  "fully_async/count/stale_trajectory_processed")
"""Step metrics that count over the run (verl's): a restarted trainer goes on from the log's
last StepFinished (trainer.metrics.AsyncCounts)."""

KEEP_WEIGHT_EVENTS = 8  # newest WeightsPublished kept in the state (blob clean-up, hash check)
KEEP_EARLIER_CHECKPOINTS = 1  # fallbacks when the newest checkpoint's file is missing


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint of ``step`` (trainer.resume.write_checkpoint)."""
    return f"step-{step:06d}.pt"


def _promote(state: TrainerState) -> TrainerState:
    """Make the newest checkpoint of a finished step the usable one; drop the step records
    it makes unnecessary."""
    ready = [c for c in state.unfinished_checkpoints if c[0] <= state.last_step]
    if not ready:
        return state
    # Of one step's copies, the last written wins (max() would compare paths).
    best = max(ready, key=lambda c: c[0])
    best = [c for c in ready if c[0] == best[0]][-1]
    earlier = state.earlier_checkpoints
    if state.checkpoint_at is not None:
        if state.checkpoint_at[0] > best[0]:
            best = state.checkpoint_at
        elif state.checkpoint_at != best:
            earlier = (*earlier, state.checkpoint_at)
    earlier = tuple(c for c in earlier if c[0] < best[0])[-KEEP_EARLIER_CHECKPOINTS:]
    oldest = earlier[0][0] if earlier else best[0]
    unfinished = tuple(c for c in state.unfinished_checkpoints if c[0] > state.last_step)
    kept = {path for _, path in (best, *earlier, *unfinished)}
    return msgspec.structs.replace(
        state,
        checkpoint_at=best,
        earlier_checkpoints=earlier,
        unfinished_checkpoints=unfinished,
        steps=tuple(s for s in state.steps if s.step > oldest),
        checkpoint_files={p: f for p, f in state.checkpoint_files.items() if p in kept},
    )


def refusal(state: TrainerState, msg: Message) -> str | None:
    """Why ``msg`` contradicts ``state`` (it is not folded), or None (folded, or passed
    over as a copy of a fact already folded). See the module docstring for the rules."""
    match msg:
        case StepFinished(step=step):
            if step <= state.last_step:
                return None  # a copy of a write (at-least-once): passed over by apply
            if step != state.last_step + 1:
                return (f"StepFinished({step}) skips steps: the last finished step is "
                        f"{state.last_step}")
            return ledger_refusal(state.ledger, msg)
        case CheckpointSaved(step=step, path=path):
            if step != state.last_step + 1:
                return (f"CheckpointSaved({step}) is not of the step being finished "
                        f"({state.last_step + 1})")
            if PurePath(path).name != checkpoint_name(step):
                return f"CheckpointSaved({step}) names {path!r}, not a {checkpoint_name(step)}"
        case RunFinished(steps=steps, validation_only=validation_only):
            if (steps < 1 and not validation_only) or steps != state.last_step:
                return (f"RunFinished(steps={steps}) does not match the last finished step "
                        f"({state.last_step})")
        case _:
            return ledger_refusal(state.ledger, msg)
    return None


def take(state: TrainerState, msg: Message) -> tuple[TrainerState, str | None]:
    """``(state after msg, None)``, or ``(state, why msg was refused)``."""
    why = refusal(state, msg)
    return (state, why) if why is not None else (_apply(state, msg), None)


def apply(state: TrainerState, msg: Message) -> TrainerState:
    """Fold one event into the state; events that do not concern the trainer, and those
    :func:`refusal` refuses, change nothing."""
    return take(state, msg)[0]


def _apply(state: TrainerState, msg: Message) -> TrainerState:
    replace = msgspec.structs.replace
    if isinstance(msg, StepFinished) and msg.step <= state.last_step:
        return state  # a copy of a write (at-least-once) changes nothing, the ledger neither
    ledger = ledger_apply(state.ledger, msg)
    if ledger is not state.ledger:
        state = replace(state, ledger=ledger)
    match msg:
        case RunStarted(config=config):
            trainer_cfg = config.get("trainer", {}) if isinstance(config, dict) else {}
            if not isinstance(trainer_cfg, dict):
                trainer_cfg = {}
            total = trainer_cfg.get("total_training_steps", 0)
            return replace(state, started=True, finished=False,
                           total_steps=total if isinstance(total, int) else 0,
                           ranks=_ranks(trainer_cfg))
        case StepFinished(step=step, sample_ids=ids, param_version=version, entry_ids=entry_ids,
                          metrics=metrics):
            record = StepRecord(step, tuple(ids), version, tuple(entry_ids))
            counts = {k: metrics[k] for k in RUNNING_COUNTS if k in metrics}
            return _promote(replace(state, last_step=step, steps=(*state.steps, record),
                                    counts=counts or state.counts))
        case WeightsPublished(version=version, ref=ref):
            kept = (*state.weights, (version, ref))[-KEEP_WEIGHT_EVENTS:]
            return replace(state, weights=kept)
        case CheckpointSaved(step=step, path=path, files=files):
            pending = (*state.unfinished_checkpoints, (step, path))
            digests = {**state.checkpoint_files, path: dict(files)} if files else {
                p: f for p, f in state.checkpoint_files.items() if p != path}
            return _promote(replace(state, unfinished_checkpoints=pending,
                                    checkpoint_files=digests))
        case RunFinished():
            return replace(state, finished=True)
        case RunForked(step=step):
            return replace(state, forked_at=step)
    return state


def _ranks(trainer_cfg: dict[str, object]) -> int:
    """The trainer's rank count a RunStarted's config says (0: it does not say)."""
    nodes, per_node = trainer_cfg.get("nnodes", 1), trainer_cfg.get("n_gpus_per_node", 1)
    if isinstance(nodes, int) and isinstance(per_node, int):
        return nodes * per_node
    return 0


def fold(events: Iterable[Message], state: TrainerState | None = None,
         refused: Callable[[Message, str], None] | None = None) -> TrainerState:
    """Fold a sequence of events (in log order) into a :class:`TrainerState`; ``refused``
    hears of each event refused, with the reason."""
    state = state or TrainerState()
    for event in events:
        state, why = take(state, event)
        if why is not None and refused is not None:
            refused(event, why)
    return state
