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
import math
import pickle
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, cast

import msgspec
import torch

from bus import Bus, RunKeys
from runschema.messages import (
    BlobRef,
    FileDigest,
    Sample,
    StepFinished,
    TrainerResumed,
    WarningRaised,
)
from runtime import Failure
from runtime.history import read_history
from storage.archive import last_archived
from storage.files import atomic_file, atomic_write
from trainer.integrity import HashingWriter, bytes_digest, verify_files
from trainer.state import StepRecord, TrainerState, take
from weights.transport import is_manifest_ref, weights_digest

if TYPE_CHECKING:
    from trainer.learner import Learner

__all__ = [
    "MAX_REFUSED_WARNINGS",
    "RESUME_MARK",
    "LogRead",
    "Refused",
    "ResumeFailed",
    "RunNotCovered",
    "Snapshot",
    "WeightsMismatch",
    "Written",
    "checkpoint_fault",
    "confirmed",
    "load_checkpoint",
    "missing_checkpoint",
    "no_checkpoint_serves",
    "not_covered",
    "pick_checkpoint",
    "read_log",
    "rebuild",
    "refusal_warnings",
    "replay_groups",
    "snapshot_fault",
    "snapshot_files",
    "snapshots",
    "write_checkpoint",
]

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
    skipped_snapshots: list[str] = []
    """Why each snapshot the read passed over was corrupt (one line each)."""


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
        pick_checkpoint(state, lambda path: None if exists(path) else _missing(path))
    except ResumeFailed as exc:
        return f"run {run_id}: the log holds steps up to {state.last_step}; {exc}"
    return None


RESUME_MARK = ".resume"
"""The suffix of the empty file that marks ``step-K.pt`` as a resume point."""


class Written(NamedTuple):
    """A checkpoint on disk: its ``.pt`` and the digest of each of its files, by name
    relative to the checkpoint folder (what its CheckpointSaved records)."""

    path: Path
    files: dict[str, FileDigest]


def write_checkpoint(folder: Path, step: int, version: int,
                     payload: Callable[[Path], dict[str, Any]], snapshot: bytes,
                     shard_digests: Callable[[Path, dict[str, Any]], dict[str, FileDigest]]
                     | None = None, *, resume_point: bool = False) -> Written:
    """Write ``step-K.pt`` (fsynced, atomic) then its ``step-K.state``; blocking (run it on
    the worker thread). ``payload(path)``: what the ``.pt`` holds besides step and version
    (trainer.learner.Learner.checkpoint_payload: the model and optimizer gathered whole, or
    the shards every rank wrote beside it first, so the ``.pt`` is the commit point);
    ``shard_digests(path, payload)``: the digests of the shards it names (trainer.integrity).
    A ``resume_point`` (trainer.resumepoints) has an empty ``step-K.resume`` beside it,
    written first: retention never takes it for a user checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:06d}.pt"
    marker = path.with_suffix(RESUME_MARK)
    if resume_point:
        atomic_write(marker, b"")
    else:  # the step written again (a resume), now as the user's checkpoint
        marker.unlink(missing_ok=True)
    contents = payload(path)
    files = dict(shard_digests(path, contents)) if shard_digests is not None else {}
    # Durable before the log says it exists (retention trims); atomic: a crash leaves the
    # old checkpoint or the new one. Hashed as it is written: no second read.
    with atomic_file(path) as fh:
        hashing = HashingWriter(fh)
        torch.save({"step": step, "version": version, **contents},
                   cast(BinaryIO, hashing))
    files[path.name] = hashing.digest()
    state = path.with_suffix(".state")
    atomic_write(state, snapshot)
    files[state.name] = bytes_digest(snapshot)
    return Written(path, files)


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
    for _, _, snap in snapshot_files(folder):
        yield snap


def snapshot_files(folder: Path, skip: frozenset[str] = frozenset()
                    ) -> Iterator[tuple[Path, FileDigest, Snapshot]]:
    """``(path, digest of its bytes, snapshot)`` of each ``step-K.state`` under ``folder``
    not named in ``skip``, newest first; torn or foreign files are skipped."""
    for path in sorted(folder.glob("step-*.state"), reverse=True):
        if path.name in skip:
            continue
        try:
            data = path.read_bytes()
            yield path, bytes_digest(data), msgspec.msgpack.decode(data, type=Snapshot)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue


async def confirmed(bus: Bus, keys: RunKeys, snap: Snapshot) -> bool:
    """Whether the log still holds both the position ``snap`` was folded to and its last
    StepFinished (a log that lost its tail may hold neither, or later entries at new ids):
    only then may a resume fold from it."""
    wanted = [snap.position] + ([snap.last_finished_id] if snap.last_finished_id else [])
    return len(await bus.read_ids(keys.events, wanted)) == len(set(wanted))


def snapshot_fault(state: TrainerState, path: Path, digest: FileDigest) -> str | None:
    """Why the snapshot at ``path``, whose bytes hash to ``digest``, is not what its
    checkpoint's CheckpointSaved (folded into ``state``) recorded (None: it is, or nothing
    was recorded). A flipped byte can still decode: the fold would start from a state the
    trainer never had."""
    for files in state.checkpoint_files.values():
        want = files.get(path.name)
        if want is not None and want != digest:
            return (f"snapshot {path} does not hash to the sha256 its CheckpointSaved "
                    f"recorded (corrupt): the log was folded without it")
    return None


async def read_log(bus: Bus, keys: RunKeys, folder: Path, archive: Path | None = None,
                   skip: frozenset[str] = frozenset()) -> LogRead:
    """Fold the events log into the trainer's state, from the newest usable snapshot in the
    checkpoint folder ``folder`` (``skip``: the names of snapshots found corrupt).

    Without one, the whole log is folded: the archived events (``archive``, by default
    ``folder/../events``: what retention trimmed from the stream) and then the stream
    (runtime.history). A snapshot that does not hash to what its CheckpointSaved recorded is
    dropped and the log read again without it (:func:`snapshot_fault`)."""
    state, start, last_finished = TrainerState(), "0", None
    used: tuple[Path, FileDigest] | None = None
    found = snapshot_files(folder, skip)
    while (item := await asyncio.to_thread(next, found, None)) is not None:
        path, digest, snap = item
        if await confirmed(bus, keys, snap):
            state, start, last_finished = snap.state, snap.position, snap.last_finished_id
            used = path, digest
            break
    read = await _fold_from(bus, keys, folder, archive, state, start, last_finished)
    if used is not None and (why := snapshot_fault(read.state, *used)) is not None:
        again = await read_log(bus, keys, folder, archive, skip | {used[0].name})
        again.skipped_snapshots.insert(0, why)
        return again
    return read


async def _fold_from(bus: Bus, keys: RunKeys, folder: Path, archive: Path | None,
                     state: TrainerState, start: str, last_finished: str | None) -> LogRead:
    """Fold the log after ``start`` into ``state`` (read_log's fold)."""
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


def pick_checkpoint(state: TrainerState, fault: Callable[[str], str | None]
                    ) -> tuple[int, str | None, list[str]]:
    """The checkpoint a resume loads: the newest of a finished step with no ``fault``
    (``(0, None)`` for none: the log holds no checkpoint), and why each newer one cannot
    serve. Raises :class:`ResumeFailed` when the log names checkpoints and none can."""
    named = state.checkpoints()
    skipped: list[str] = []
    for step, path in named:
        why = fault(path)
        if why is None:
            return step, path, skipped
        skipped.append(why)
    if not named:
        return 0, None, []
    raise ResumeFailed(no_checkpoint_serves(skipped))


def _missing(path: str) -> str:
    return f"checkpoint {path} named in the log is missing"


def no_checkpoint_serves(skipped: Sequence[str]) -> str:
    """One line: no checkpoint the log names can serve, and why each cannot."""
    return f"no checkpoint the log names can be loaded: {'; '.join(skipped)}"


def checkpoint_fault(learner: Learner, local: str, files: dict[str, FileDigest]) -> str | None:
    """Why the checkpoint whose ``.pt`` is at ``local`` cannot be loaded (None: its files
    are as its CheckpointSaved recorded them; blocking). Its snapshot (``.state``) is not
    needed to load it: read_log verifies the one it folds from. A checkpoint of a log
    written before digests were is only checked to exist (a load that fails then falls back
    all the same: :func:`rebuild`)."""
    pt = Path(local)
    if not pt.is_file():
        return _missing(local)
    where = {pt.name: local}
    for name in files:
        top, sep, _ = name.partition("/")
        if sep and top not in where:
            where[top] = learner.shards_at(pt, top)
    needed = {n: f for n, f in files.items() if not n.endswith(".state")}
    return verify_files(needed, where)


LOAD_ERRORS = (RuntimeError, EOFError, OSError, ValueError, KeyError, pickle.UnpicklingError)
"""What loading a checkpoint raises when its file is not a whole checkpoint (torch's zip
reader, the unpickler, a state dict of another shape)."""


async def _load_intact(state: TrainerState, learner: Learner, off: RunOff,
                       where: Callable[[str], str],
                       warn: Callable[[WarningRaised], Awaitable[Any]] | None,
                       ) -> tuple[int, str | None]:
    """Load the newest checkpoint of a finished step whose files verify and that loads;
    each newer one that does not is told to ``warn`` (one line each, its cause). Returns its
    step and local path (``(0, None)``: the log names none); :class:`ResumeFailed` when the
    log names checkpoints and none serves."""
    named = state.checkpoints()
    skipped: list[str] = []
    corrupt = False
    for step, path in named:
        local = where(path)
        why = await asyncio.to_thread(checkpoint_fault, learner, local, state.files_of(path))
        if why is None:
            try:
                await off(learner.load_checkpoint, local)
            except (torch.OutOfMemoryError, Failure):  # memory, a rank: not the file's fault
                raise
            except LOAD_ERRORS as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                why = f"{local} could not be loaded ({type(exc).__name__}: {first})"
        if why is None:
            if skipped and warn is not None:
                await warn(WarningRaised(
                    source="trainer", code="checkpoint_corrupt" if corrupt else
                    "checkpoint_missing",
                    message=f"{'; '.join(skipped)}: resuming from {local} (step {step}) "
                            f"and re-applying the steps after it"))
            return step, local
        corrupt = corrupt or why != _missing(local)
        skipped.append(why)
    if named:
        raise ResumeFailed(no_checkpoint_serves(skipped))
    return 0, None


def mismatch_verdict(what: str, ranks_changed: tuple[int, int] | None, gap: float | None,
                     mode: str) -> tuple[bool, str, str]:
    """``(stop, warning code, line)`` for a resumed model that does not hash to the weights
    it published (``what`` says which). With the same rank count it is a mismatch: it stops
    (``mode`` = trainer.resume_weights_mismatch ``fail``) or is warned. With a rank count
    that changed (float sums in another order) the ``gap`` measured (rebuild's
    ``weights_gap``) decides: within trainer.replay.TOLERANCE it goes on with a
    ``resume_weights_tolerance`` warning saying so, farther it is a mismatch, unmeasured (no
    copy of the publication kept) it goes on with a warning saying that."""
    from trainer.replay import TOLERANCE  # it imports this module

    if ranks_changed is not None:
        what += (f"; the trainer ranks changed from {ranks_changed[0]} to {ranks_changed[1]}, "
                 f"so the re-applied steps summed floats in another order")
        if gap is None:
            return False, "resume_weights_mismatch", (
                f"{what}: not measured (no copy of the publication is kept); going on")
        if gap <= TOLERANCE:
            return False, "resume_weights_tolerance", (
                f"{what}: its distance from them is {100 * gap:.3g}% of the run's move since "
                f"the checkpoint, within the {100 * TOLERANCE:g}% tolerance; going on")
        what += (f", and its distance from them is {100 * gap:.3g}% of the run's move since "
                 f"the checkpoint, past the {100 * TOLERANCE:g}% tolerance")
    if mode == "fail":
        return True, "resume_weights_mismatch", (
            f"{what}: stopping before anything is published (a checkpoint or a sample changed "
            f"since it was trained; trainer.resume_weights_mismatch=warn goes on)")
    return False, "resume_weights_mismatch", what


class WeightsMismatch(ResumeFailed):
    """A resume rebuilt a model that does not hash to the weights the trainer published
    for that version: it would publish weights its rollouters never had as the next
    version's parent. The trainer stops before it publishes anything
    (``trainer.resume_weights_mismatch=warn`` lets it go on)."""


Tensors = dict[str, torch.Tensor]


async def _published_digest(learner: Learner, off: RunOff, manifest: bool,
                            tensors: Tensors | None = None) -> str:
    """The digest the learner's weights would be published under (a transport's manifest
    digest of ``tensors``, its snapshot taken here when not given, or the sha256 of the
    serialised blob); off the loop."""
    if manifest:
        if tensors is None:
            tensors = await off(learner.snapshot)
        return str(await asyncio.to_thread(weights_digest, tensors))
    blob = await off(learner.state_bytes)
    return hashlib.sha256(blob).hexdigest()


async def rebuild(bus: Bus, keys: RunKeys, state: TrainerState, learner: Learner,
                  off: RunOff, trigger: int, events_read: int,
                  warn: Callable[[WarningRaised], Awaitable[Any]] | None = None,
                  locate: Callable[[str], str] | None = None,
                  published_tensors: Callable[[BlobRef], Awaitable[Tensors | None]] | None
                  = None) -> TrainerResumed:
    """Rebuild the model the trainer had: load the newest checkpoint of a finished step
    whose files verify (:func:`_load_intact`: a corrupt, truncated or missing newer one is
    told to ``warn``), re-apply the finished steps after it from the entries their
    StepFinished recorded, and check the model against the weights the trainer published
    for its version (``weights_match``). That version was published after step
    ``version * trigger``: the model is hashed when it is at that step (after the load or
    the replayed step), not at the last step, which is mid-window with ``trigger`` > 1.
    ``off`` runs blocking work on the trainer's worker thread; ``locate``: the local file of
    a checkpoint the log names (trainer.mirror; default: that path). ``published_tensors``
    (given when the trainer ranks changed since the run's last start, so that the re-applied
    steps sum floats in another order and no hash can match): the published weights read
    back, against which the model re-applied to that version is measured
    (``weights_gap``: trainer.replay.state_difference, relative to the move since the
    checkpoint)."""
    await learner.optimizer_ready()
    where = (lambda path: path) if locate is None else locate
    ckpt_step, _ = await _load_intact(state, learner, off, where, warn)
    # Derived from finished steps, not from the newest WeightsPublished: weights published
    # by a step that never finished are superseded when that step is trained again.
    version = state.last_step // trigger
    published = state.weights_of(version)
    at_step = version * trigger
    manifest = published is not None and is_manifest_ref(published)
    digest, gap = None, None
    # The gap is measured only where the publication's bytes are kept (its tensors read
    # back) and the model reaches its version by re-applied steps: from the window's start.
    theirs = start = None
    if published is not None and ckpt_step == at_step:
        digest = await _published_digest(learner, off, manifest)
    elif published is not None and published_tensors is not None and ckpt_step < at_step:
        theirs = await published_tensors(published)
        start = await off(learner.snapshot) if theirs is not None else None
    replay = state.steps_after_checkpoint(ckpt_step)
    for rec in replay:
        groups = await replay_groups(bus, keys, rec)
        learner.version = (rec.step - 1) // trigger  # the version it held for that step
        await off(learner.update, groups)
        if published is not None and rec.step == at_step:
            ours = await off(learner.snapshot) if manifest else None
            digest = await _published_digest(learner, off, manifest, ours)
            if ours is not None and theirs is not None and start is not None:
                gap = await asyncio.to_thread(_gap, ours, theirs, start)
                theirs = start = None
    learner.version = version
    # None: nothing to compare (never published, or published before the checkpoint).
    match = None if digest is None or published is None else digest == published.sha256
    return TrainerResumed(step=state.last_step, param_version=learner.version,
                          checkpoint_step=ckpt_step, replayed_steps=len(replay),
                          weights_match=match, events_read=events_read, weights_gap=gap)


def _gap(ours: Tensors, theirs: Tensors, start: Tensors) -> float:
    """How far ``ours`` lies from the published ``theirs``, relative to the run's move from
    ``start`` (trainer.replay.state_difference); blocking."""
    from trainer.replay import TOLERANCE, state_difference  # it imports this module

    d = state_difference(ours, theirs, start)
    # Within the bound yet not within: a weight missing or reshaped, never close.
    return d.ratio if d.within or d.ratio > TOLERANCE else math.inf
