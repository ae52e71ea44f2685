"""What a restarted trainer reads back: checkpoints with state snapshots, the log after them,
and the exact samples of the steps to re-apply.

A checkpoint is a snapshot; the streams are the log. Each checkpoint ``step-K.pt`` (model and
optimizer) has a side file ``step-K.state``: the trainer's folded state and the events
position it was folded up to. :func:`read_log` starts from the newest snapshot whose position
the log still holds, so a resume reads only what happened since; with none, it folds the log
from its beginning (``state = fold(events)`` either way).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from bus import Bus, RunKeys
from runschema.messages import Sample, StepFinished, TrainerResumed, WarningRaised
from runtime import Failure
from runtime.history import read_history
from storage.archive import last_archived
from storage.files import atomic_file, atomic_write
from trainer.state import StepRecord, TrainerState, take
from weights.transport import is_manifest_ref, weights_digest

if TYPE_CHECKING:
    from trainer.learner import Learner

__all__ = ["MAX_REFUSED_WARNINGS", "LogRead", "Refused", "ResumeFailed", "RunNotCovered",
           "Snapshot", "load_checkpoint", "missing_checkpoint", "not_covered", "pick_checkpoint",
           "read_log", "rebuild", "refusal_warnings", "replay_groups", "snapshots",
           "write_checkpoint"]

RunOff = Callable[..., Awaitable[Any]]


class Snapshot(msgspec.Struct, frozen=True):
    """The trainer's folded state as of events ``position`` (saved beside a checkpoint)."""

    state: TrainerState
    position: str
    last_finished_id: str | None = None


class ResumeFailed(Failure):
    """The log names what a resume needs and it is not there (a checkpoint file, the samples
    of a step to re-apply): one line and a ComponentFailed, not a traceback."""


class RunNotCovered(ResumeFailed):
    """The log holds steps this trainer cannot restore: the checkpoint or the events archive
    that covers them is not in its storage (another node's disk, another ``run.output_dir``).
    A trainer never trains from scratch inside a run that has steps: exit 2, naming the run,
    the last step of the log and what is missing (:func:`not_covered`). Nothing is written
    to the run's log: the trainer did not start."""

    code = 2
    publish = False


class Refused(msgspec.Struct, frozen=True):
    """An event of the log the fold refused (trainer.state.refusal): where, what, why."""

    entry_id: str
    kind: str
    reason: str


MAX_REFUSED_WARNINGS = 16  # fact_refused warnings at start; the rest are counted in one


def refusal_warnings(refused: Sequence[Refused]) -> list[WarningRaised]:
    """One ``fact_refused`` warning per refused event, at most :data:`MAX_REFUSED_WARNINGS`;
    the rest counted in one more."""
    warnings = [WarningRaised(source="trainer", code="fact_refused",
                              message=f"{r.kind} at {r.entry_id} not folded: {r.reason}")
                for r in refused[:MAX_REFUSED_WARNINGS]]
    if len(refused) > MAX_REFUSED_WARNINGS:
        warnings.append(WarningRaised(
            source="trainer", code="fact_refused",
            message=f"and {len(refused) - MAX_REFUSED_WARNINGS} more events not folded"))
    return warnings


class LogRead(msgspec.Struct):
    """The folded state, the id of the last entry folded, the id of the last StepFinished,
    how many entries this read folded, and the events it refused."""

    state: TrainerState
    position: str | None
    last_finished_id: str | None
    entries_read: int
    refused: list[Refused] = []
    log_last_step: int = 0
    """The newest step a StepFinished read names, folded or not (what the log says happened)."""
    archive_missing: bool = False
    """The stream was trimmed (the archive's location is recorded in Redis) and this read,
    from the log's beginning, found nothing in its archive: the trimmed part was not read."""
    archive_written: str | None = None
    """Where the trainer that trimmed the stream wrote the archive (as it recorded it)."""


def not_covered(run_id: str, read: LogRead, checkpoints: str, archive: str) -> str | None:
    """Why a trainer must not start on what ``read`` folded (None: it may). The log holds
    steps the fold could not account for when its trimmed part was not read (the archive in
    ``archive`` is missing or empty) or when StepFinished events were read without the
    RunStarted before them; a resume from scratch would train again, inside the run, steps
    the log says happened. ``checkpoints``: where the trainer looked for checkpoints."""
    last = max(read.log_last_step, read.state.last_step)
    if read.archive_missing:
        written = "" if read.archive_written in (None, archive) else (
            f", it was written at {read.archive_written}")
        return (f"run {run_id}: the events stream was trimmed and its archive {archive} holds "
                f"nothing (the log reads up to step {last}{written}; checkpoints looked for "
                f"in {checkpoints}): start the trainer on the run's storage")
    if read.log_last_step > read.state.last_step and not read.state.started:
        # Steps without the RunStarted before them: the log's beginning was not read. (A
        # forged StepFinished in a log read whole is refused and reported, not this.)
        return (f"run {run_id}: the log holds steps up to {read.log_last_step} but only "
                f"{read.state.last_step} could be restored (no checkpoint snapshot in "
                f"{checkpoints}, no archived events in {archive}): start the trainer on the "
                f"run's storage")
    return None


def missing_checkpoint(run_id: str, state: TrainerState, exists: Callable[[str], bool]
                       ) -> str | None:
    """Why a trainer must not start (None: it may): the log names checkpoints and none of
    them ``exists`` here (pick_checkpoint would fail after the model was built)."""
    try:
        pick_checkpoint(state, exists)
    except ResumeFailed as exc:
        return f"run {run_id}: the log holds steps up to {state.last_step}; {exc}"
    return None


def write_checkpoint(folder: Path, step: int, version: int,
                     payload: Callable[[Path], dict[str, Any]], snapshot: bytes) -> Path:
    """Write ``step-K.pt`` (fsynced, atomic) then its ``step-K.state``; blocking (run it on
    the worker thread). ``payload(path)``: what the ``.pt`` holds besides step and version
    (trainer.learner.Learner.checkpoint_payload: the model and optimizer gathered whole, or
    the shards every rank wrote beside it first, so the ``.pt`` is the commit point)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:06d}.pt"
    contents = payload(path)
    # Durable before the log says it exists (retention trims); atomic: a crash leaves the
    # old checkpoint or the new one.
    with atomic_file(path) as fh:
        torch.save({"step": step, "version": version, **contents}, fh)
    atomic_write(path.with_suffix(".state"), snapshot)
    return path


def load_checkpoint(path: str, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    device: Any) -> None:
    """Load model and optimizer from ``path``; blocking."""
    ckpt = torch.load(path, map_location=device, weights_only=True)
    policy.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])


def snapshots(folder: Path) -> Iterator[Snapshot]:
    """The state snapshots saved with checkpoints under ``folder``, newest first, decoded one
    at a time (a resume stops at the first the log confirms; torn or foreign files are
    skipped)."""
    for path in sorted(folder.glob("step-*.state"), reverse=True):
        try:
            yield msgspec.msgpack.decode(path.read_bytes(), type=Snapshot)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue


async def read_log(bus: Bus, keys: RunKeys, folder: Path, archive: Path | None = None) -> LogRead:
    """Fold the events log into the trainer's state, from the newest usable snapshot in the
    checkpoint folder ``folder``.

    Without one, the whole log is folded: the archived events (``archive``, by default
    ``folder/../events``: what retention trimmed from the stream) and then the stream
    (runtime.history)."""
    state, start, last_finished = TrainerState(), "0", None
    found = snapshots(folder)
    while (snap := await asyncio.to_thread(next, found, None)) is not None:
        # Both its position and its last StepFinished must still be in the log (a log that
        # lost its tail may hold neither, or later entries at new ids).
        wanted = [snap.position] + ([snap.last_finished_id] if snap.last_finished_id else [])
        if len(await bus.read_ids(keys.events, wanted)) == len(set(wanted)):
            state, start, last_finished = snap.state, snap.position, snap.last_finished_id
            break
    position = None if start == "0" else start
    read = 0
    refused: list[Refused] = []
    archive = folder.parent / "events" if archive is None else archive
    # From the beginning of a trimmed stream, the archive must supply the trimmed part.
    written = await bus.get_text(keys.archive) if start == "0" else None
    missing = written is not None and await asyncio.to_thread(last_archived, archive) is None
    logged = 0
    async for entry in read_history(bus, keys.events, archive, start):
        read += 1
        before = state.last_step
        state, why = take(state, entry.msg)
        position = entry.id
        if isinstance(entry.msg, StepFinished):
            logged = max(logged, entry.msg.step)
        if why is not None:
            refused.append(Refused(entry.id, type(entry.msg).__name__, why))
        elif isinstance(entry.msg, StepFinished) and state.last_step > before:
            last_finished = entry.id
    return LogRead(state, position, last_finished, read, refused, logged, missing, written)


async def replay_groups(bus: Bus, keys: RunKeys, rec: StepRecord) -> list[list[Sample]]:
    """The exact samples step ``rec`` trained, grouped by ticket in training order."""
    if rec.entry_ids:
        found = await bus.read_ids(keys.samples, list(rec.entry_ids))
        by_id = {eid: found.get(eid) for eid in rec.entry_ids}
        samples = [m for m in by_id.values() if isinstance(m, Sample)]
        missing = [sid for sid, eid in zip(rec.sample_ids, rec.entry_ids, strict=False)
                   if not isinstance(by_id.get(eid), Sample)]
    else:  # a log written before entry ids were recorded: look the ids up
        wanted = set(rec.sample_ids)
        by_sid: dict[str, Sample] = {}
        async for _, msg in bus.read_all(keys.samples):
            if isinstance(msg, Sample) and msg.sample_id in wanted:
                by_sid.setdefault(msg.sample_id, msg)
        samples = [by_sid[sid] for sid in rec.sample_ids if sid in by_sid]
        missing = [sid for sid in rec.sample_ids if sid not in by_sid]
    if missing:
        raise ResumeFailed(
            f"cannot re-apply step {rec.step}: samples {missing[:3]} are no longer in "
            f"{keys.samples}"
        )
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.ticket_id, []).append(s)
    return [sorted(g, key=lambda s: s.index) for g in groups.values()]


def pick_checkpoint(state: TrainerState, exists: Callable[[str], bool]
                    ) -> tuple[int, str | None, list[str]]:
    """The checkpoint a resume loads: the newest of a finished step whose file ``exists``
    (``(0, None)`` for none: the log holds no checkpoint), and the newer files that are
    missing. Raises :class:`ResumeFailed` when the log names checkpoints and none exists."""
    named = state.checkpoints()
    missing: list[str] = []
    for step, path in named:
        if exists(path):
            return step, path, missing
        missing.append(path)
    if not named:
        return 0, None, []
    raise ResumeFailed(f"checkpoint {missing[0]} named in the log is missing, and so is every "
                       f"earlier one the log names ({', '.join(missing[1:]) or 'none'})")


async def rebuild(bus: Bus, keys: RunKeys, state: TrainerState, learner: Learner,
                  off: RunOff, trigger: int, events_read: int,
                  warn: Callable[[WarningRaised], Awaitable[Any]] | None = None,
                  locate: Callable[[str], str] | None = None,
                  ) -> TrainerResumed:
    """Rebuild the model the trainer had: load the newest checkpoint of a finished step
    whose file exists (pick_checkpoint; a missing newer one is told to ``warn``), re-apply
    the finished steps after it from the entries their StepFinished recorded, and check the
    result against the weights the trainer had published (``weights_match``). ``off`` runs
    blocking work on the trainer's worker thread; ``locate``: the local file of a checkpoint
    the log names (trainer.mirror; default: that path)."""
    await learner.optimizer_ready()
    where = (lambda path: path) if locate is None else locate
    ckpt_step, named, missing = await asyncio.to_thread(
        pick_checkpoint, state, lambda path: os.path.exists(where(path)))
    ckpt_path = None if named is None else where(named)
    if missing and warn is not None:
        await warn(WarningRaised(
            source="trainer", code="checkpoint_missing",
            message=f"checkpoint {missing[0]} named in the log is missing; resuming from "
                    f"{ckpt_path} (step {ckpt_step}) and re-applying the steps after it"))
    if ckpt_path is not None:
        await off(learner.load_checkpoint, ckpt_path)
    replay = state.steps_after_checkpoint(ckpt_step)
    for rec in replay:
        groups = await replay_groups(bus, keys, rec)
        learner.version = (rec.step - 1) // trigger  # the version it held for that step
        await off(learner.update, groups)
    # Derived from finished steps, not from the newest WeightsPublished: weights published
    # by a step that never finished are superseded when that step is trained again.
    learner.version = state.last_step // trigger
    published = state.weights_of(learner.version)
    match = None
    if published is not None and is_manifest_ref(published):
        # Published through a weight transport: the digest of the manifest the same
        # tensors would have (chunk by chunk, off the loop).
        tensors = await off(learner.snapshot)
        match = await asyncio.to_thread(weights_digest, tensors) == published.sha256
    elif published is not None:
        blob = await off(learner.state_bytes)
        match = hashlib.sha256(blob).hexdigest() == published.sha256
    return TrainerResumed(step=state.last_step, param_version=learner.version,
                          checkpoint_step=ckpt_step, replayed_steps=len(replay),
                          weights_match=match, events_read=events_read)
