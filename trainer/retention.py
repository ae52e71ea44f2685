"""Retention of the events log and of checkpoint files (``run.retention=checkpoint``).

After the durable checkpoint of step ``k`` the trainer calls :func:`trim_after_checkpoint`,
off the step's critical path: the samples and tickets before it are needed by no resume
(``trim_safely`` never removes an entry any group still has pending or undelivered: those
later steps need), and :func:`retain` archives and trims the events.

The events safe point is the lowest of

- the newest snapshot the log confirms (``step-K.state``, as a resume would choose it): its
  position and the StepFinished it names, since a resume checks both and folds only what
  follows (the snapshot file is fsynced first);
- the oldest of the newest ``keep_weights`` WeightsPublished in the stream: a starting
  rollouter takes the newest publication it reads (and falls back to older loadable ones);
- the stored position of every live reader (the profiler service's snapshot, each live
  rollouter's read position: :meth:`bus.RunKeys.events_readers`), re-checked atomically by
  the trim.

Everything before it is appended to the archive (``OUTPUT_DIR/RUN/events``) and only then
trimmed (:func:`runtime.history.archive_below`). Nothing a starting component needs lies before
it: a rollouter's step clock and weights, the trainer's resume and the barrier key are all
at or after it; readers of the whole log read the archive first
(:func:`runtime.history.read_history`).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import msgspec

from bus import Bus, RunKeys, entry_key
from runschema.messages import WarningRaised, WeightsPublished
from runtime.history import Archived, archive_below, events_folder
from storage.files import fsync_path
from storage.record import RecordCorrupt
from trainer.export import step_folder
from trainer.mirror import CheckpointMirror, EventsMirror
from trainer.record import Recorder
from trainer.resume import RESUME_MARK, Snapshot, confirmed, snapshot_files

__all__ = ["Retained", "checkpoints_to_drop", "events_safe_point", "newest_snapshot",
           "retain", "trim_after_checkpoint"]

_CKPT = re.compile(r"^step-(\d+)\.pt$")
_MARK = re.compile(r"^step-(\d+)\.resume$")


async def newest_snapshot(bus: Bus, keys: RunKeys, folder: Path) -> tuple[Path, Snapshot] | None:
    """The snapshot a resume would use now (the newest whose position and last StepFinished
    the log holds), made durable (file and folder fsynced); None when there is none."""
    found = snapshot_files(folder)
    while (item := await asyncio.to_thread(next, found, None)) is not None:
        path, _, snap = item
        if await confirmed(bus, keys, snap):
            await asyncio.to_thread(fsync_path, path)
            await asyncio.to_thread(fsync_path, folder)
            return path, snap
    return None


async def events_safe_point(
    bus: Bus, keys: RunKeys, snapshot: Snapshot, keep_weights: int
) -> str:
    """The id before which no reader needs the events stream (see the module docstring;
    live readers' stored positions are applied by the trim itself)."""
    candidates = [snapshot.position]
    if snapshot.last_finished_id:
        candidates.append(snapshot.last_finished_id)
    # The stream holds a few checkpoint windows: reading it for the publications is cheap.
    published: list[str] = []
    async for entry in bus.read_all(keys.events):
        if isinstance(entry.msg, WeightsPublished):
            published.append(entry.id)
    if published:
        candidates.append(published[-keep_weights:][0])
    return min(candidates, key=entry_key)


KEEP_NEWEST = 2
"""Checkpoints of either kind never deleted for being a resume point: the newest, and the
one a resume falls back to when the newest is corrupt (trainer.resume)."""


def checkpoints_to_drop(
    steps: list[int], keep: int | None, last_step: int, needed: set[int],
    resume_points: frozenset[int] = frozenset(),
) -> list[int]:
    """Checkpoint steps to delete, of the finished steps (``<= last_step``): the user's
    checkpoints but the newest ``keep`` (None: keep them all), and the ``resume_points``
    (trainer.resumepoints) but those among the newest :data:`KEEP_NEWEST` checkpoints of
    either kind. Never one in ``needed`` (what a resume may load) and never a file of a
    step not finished yet (a crashed incarnation's; the step will write it again)."""
    finished = sorted(s for s in steps if s <= last_step)
    users = [s for s in finished if s not in resume_points]
    kept = {s for s in finished[-KEEP_NEWEST:] if s in resume_points} | set(needed)
    kept |= set(users if keep is None else users[-keep:] if keep > 0 else [])
    return [s for s in finished if s not in kept]


def _step_of(path: str | None) -> int | None:
    if path is None:
        return None
    m = _CKPT.match(Path(path).name)
    return int(m[1]) if m else None


def _drop(folder: Path, keep: int | None, last_step: int, needed: set[int]) -> list[int]:
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    steps = [int(m[1]) for n in names if (m := _CKPT.match(n))]
    marked = frozenset(int(m[1]) for n in names if (m := _MARK.match(n)))
    dropped = checkpoints_to_drop(steps, keep, last_step, needed, marked)
    for step in dropped:
        # The snapshot first (it names the checkpoint); a resume point's mark last: the
        # .pt is never left unmarked.
        for suffix in (".state", ".pt", RESUME_MARK):
            path = folder / f"step-{step:06d}{suffix}"
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        # Its shards (trainer.checkpoint_format dcp), then its Hugging Face directory: an
        # export still writing it checks for the .pt after its rename (trainer.export).
        shutil.rmtree(folder / f"step-{step:06d}.dcp", ignore_errors=True)
        shutil.rmtree(step_folder(folder, step), ignore_errors=True)
    if dropped:
        fsync_path(folder)
    return dropped


def _needed(current: str | None, found: tuple[Path, Snapshot] | None) -> set[int]:
    """Checkpoint steps a resume may load: the trainer's current one, the newest confirmed
    snapshot's own (``step-K.state`` beside ``step-K.pt``) and the one that snapshot's state
    names (loaded when the log lost the entries after the snapshot)."""
    needed = {s for s in (_step_of(current),) if s is not None}
    if found is not None:
        path, snap = found
        if snap.state.checkpoint_at is not None:
            needed.add(snap.state.checkpoint_at[0])
        m = re.match(r"^step-(\d+)\.state$", path.name)
        if m:
            needed.add(int(m[1]))
    return needed


def _pusher(mirror: EventsMirror | None) -> Callable[[], Awaitable[None]] | None:
    """What :func:`runtime.history.archive_below` awaits before the trim: the archive's copy
    in the storage brought up to date, on a worker thread."""
    if mirror is None:
        return None
    return lambda: asyncio.to_thread(mirror.push)


class Retained(msgspec.Struct, frozen=True):
    """What one :func:`retain` did."""

    events: Archived
    dropped_checkpoints: tuple[int, ...] = ()


async def retain(
    bus: Bus, keys: RunKeys, run_dir: Path, *, keep_weights: int,
    keep_checkpoints: int | None, last_step: int, current: str | None,
    fence: tuple[str, str] | None = None, rollouter_ranks: Sequence[int] = (),
    checkpoints: Path | None = None, mirror: CheckpointMirror | None = None,
    events_mirror: EventsMirror | None = None,
) -> Retained:
    """After a durable checkpoint: archive then trim the events before the safe point, and
    (``keep_checkpoints``, verl's ``trainer.max_actor_ckpt_to_keep``; None keeps all)
    delete the checkpoints and ``.state`` snapshots older than the newest that many, never
    one a resume may load (``current``: the trainer's state's checkpoint path), each with
    its Hugging Face directory (``global_step_K``). ``checkpoints``: the checkpoint folder
    (runconfig.paths.checkpoint_dir; default ``run_dir/checkpoints``). Without a snapshot
    the log confirms, nothing is trimmed or deleted. ``mirror``: on a remote storage, its
    copies of the dropped checkpoints are deleted too, and ``events_mirror`` gets the archive
    before the trim (trainer.mirror). File work runs on worker threads."""
    folder = run_dir / "checkpoints" if checkpoints is None else checkpoints
    found = await newest_snapshot(bus, keys, folder)
    if found is None:
        return Retained(Archived(0, 0, None))
    below = await events_safe_point(bus, keys, found[1], keep_weights)
    events = await archive_below(bus, keys.events, events_folder(run_dir.parent, keys.run_id),
                                 below, readers=keys.events_readers(rollouter_ranks), fence=fence,
                                 location_key=keys.archive,
                                 before_trim=_pusher(events_mirror))
    dropped = await asyncio.to_thread(_drop, folder, keep_checkpoints, last_step,
                                      _needed(current, found))
    if dropped and mirror is not None:
        await asyncio.to_thread(mirror.delete, dropped)
    return Retained(events, tuple(dropped))


async def trim_after_checkpoint(
    bus: Bus, keys: RunKeys, run_dir: Path, trained: Sequence[str], *, keep_weights: int,
    keep_checkpoints: int | None, last_step: int, current: str | None,
    fence: tuple[str, str], rollouter_ranks: Sequence[int], checkpoints: Path | None = None,
    mirror: CheckpointMirror | None = None, events_mirror: EventsMirror | None = None,
    recorder: Recorder | None = None,
) -> WarningRaised | None:
    """Retention (``run.retention=checkpoint``) after the durable checkpoint of the step that
    trained the samples ``trained``: samples before the newest of them (copied to the run's
    record first: ``recorder``), tickets before the newest ticket, and the events before the
    safe point (:func:`retain`). Returns the warning to publish when the record or the
    archive could not be written (then nothing they would hold was trimmed)."""
    warning = await _record_and_trim(bus, keys, trained, recorder) if trained else None
    latest = await bus.latest(keys.prompts)
    if latest is not None:
        await bus.trim_safely(keys.prompts, minid=latest.id)
    try:
        await retain(bus, keys, run_dir, keep_weights=keep_weights,
                     keep_checkpoints=keep_checkpoints, last_step=last_step, current=current,
                     fence=fence, rollouter_ranks=rollouter_ranks, checkpoints=checkpoints,
                     mirror=mirror, events_mirror=events_mirror)
    except OSError as exc:
        return WarningRaised(source="trainer", code="events_not_archived",
                             message=f"events stream not trimmed: the archive failed: {exc}")
    return warning


async def _record_and_trim(bus: Bus, keys: RunKeys, trained: Sequence[str],
                           recorder: Recorder | None) -> WarningRaised | None:
    """Trim the samples before the newest of ``trained``, copied to the run's record first;
    the warning when the record could not be written (then nothing is trimmed)."""
    cut = max(trained, key=entry_key)
    if recorder is not None:
        # Only entries below the group's floor are done with: record exactly what the trim
        # will remove (the floor never drops, so the trim removes no more).
        floor = await bus.trim_floor(keys.samples)
        if floor is not None:
            cut = min(cut, floor, key=entry_key)
        try:
            await recorder.record_below(cut)
        except (OSError, RecordCorrupt) as exc:
            return WarningRaised(source="trainer", code="record_not_written",
                                 message=f"samples stream not trimmed: the run's record "
                                         f"failed: {exc}")
    await bus.trim_safely(keys.samples, minid=cut)
    return None
