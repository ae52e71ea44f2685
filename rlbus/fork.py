"""``rlbus fork --run RUN --at K --new-run NEW [KEY=VALUE ...]``: a new run that goes on from
RUN's state after step K with other settings.

What it writes, before anything of NEW runs:

- NEW's checkpoint of step K (``step-K.pt`` in NEW's checkpoint folder): RUN's model and
  optimizer after step K, rebuilt as ``rlbus replay`` rebuilds them (the newest intact
  checkpoint at or before K plus the recorded samples of the steps after it) and checked
  against the weights RUN published there: a model that differs is not forked from (exit 1).
- Beside it, ``step-K.state``: the trainer's state after step K as RUN's log folds it (its
  ledger and data position: the next ticket is the one RUN would have issued next), naming
  that checkpoint with its digest. The tickets RUN had open at K (issued, not yet trained:
  at most the staleness budget) are not carried over: their samples are RUN's; NEW issues
  new tickets from the data position, and ``RunForked.dropped_tickets`` names them.
- NEW's log: a RunStarted with NEW's config (RUN's config at K, the overrides on top), RUN's
  StepFinished events of steps 1-K as they are (their metrics: TensorBoard overlays NEW on
  RUN from step K; their samples are in RUN's record), then ``RunForked`` naming RUN, K and
  the overrides. The state snapshot's position is the RunForked entry: NEW's trainer resumes
  from it as from any checkpoint (``weights_match`` against RUN's publication).

Then ``rlbus up run.id=NEW`` (same ``run.output_dir`` and Redis) trains steps K+1 onwards. A
key that would make the checkpoint unloadable or the step count mean another thing (the
model, ``trigger_parameter_sync_step``, the trainer's ranks) is refused (exit 2), naming it.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from bus import RUNS_STREAM, Bus, RunKeys
from runconfig import Config, config_to_dict, load_config
from runconfig.paths import checkpoint_dir, events_dir, local_root, record_dir
from runschema.messages import RunForked, RunStarted, StepFinished, WeightsPublished
from runtime.history import find_archive, read_history
from storage.files import atomic_write
from trainer.replay import group_in_order
from trainer.resume import Snapshot, write_checkpoint
from trainer.state import TrainerState, checkpoint_name, take

__all__ = ["fork_run"]

_REFUSED = ("model.", "async_training.trigger_parameter_sync_step", "trainer.nnodes",
            "trainer.n_gpus_per_node", "trainer.checkpoint_format")


class ParentAt(NamedTuple):
    """The parent's log up to step K: its trainer state, its StepFinished events and the
    entry id of the last."""

    state: TrainerState
    finished: list[StepFinished]
    position: str


async def _parent_at(url: str, run_id: str, archive: Path, step: int) -> ParentAt | None:
    bus = Bus.from_url(url)
    keys = RunKeys(run_id)
    state, finished, position = TrainerState(), [], ""
    try:
        folder = await find_archive(bus, keys, archive)
        async for entry in read_history(bus, keys.events, folder or archive):
            msg = entry.msg
            if position:  # after step K: only the weights it published (after its StepFinished)
                if isinstance(msg, StepFinished):
                    break
                if isinstance(msg, WeightsPublished) and msg.step <= step:
                    state, _ = take(state, msg)
                continue
            state, why = take(state, msg)
            if why is None and isinstance(msg, StepFinished):
                finished.append(msg)
                if msg.step == step:
                    position = entry.id
    finally:
        await bus.close()
    return ParentAt(state, finished, position) if position else None


async def _log_is_empty(url: str, run_id: str) -> bool:
    bus = Bus.from_url(url)
    try:
        return await bus.latest_id(RunKeys(run_id).events) is None
    finally:
        await bus.close()


def _refusal(overrides: list[str]) -> str | None:
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if key.startswith(_REFUSED) or key.startswith("actor_rollout_ref.model."):
            return (f"{key}: the fork starts from the parent's checkpoint and step count; this "
                    f"key would make them another model's or mean other steps")
    return None


def _fork_state(parent: TrainerState, step: int, total: int, pt: str, files: dict[str, Any]
                ) -> tuple[TrainerState, list[str]]:
    """The forked run's state after ``step``: the parent's, its checkpoint NEW's, its open
    tickets dropped (their ids returned)."""
    ledger = parent.ledger
    dropped = [f"t{i}" for i in sorted(ledger.open)]
    ledger = msgspec.structs.replace(ledger, open={}, window=0)
    state = msgspec.structs.replace(
        parent, finished=False, total_steps=total, checkpoint_at=(step, pt),
        earlier_checkpoints=(), unfinished_checkpoints=(), steps=(), ledger=ledger,
        checkpoint_files={pt: files}, forked_at=step)
    return state, dropped


_OWN_FOLDERS = ("trainer.default_local_dir", "trainer.rollout_data_dir",
                "trainer.validation_data_dir")
"""Folders a run writes its own files into by a fixed name (checkpoints ``step-K.pt``, dumps
``{step}.jsonl``): a fork that inherited the parent's would write over the parent's files."""


def _own_folders(base: Config, new: Config) -> tuple[Config, list[str]]:
    """``new`` without the parent's folders it inherited unchanged (the fork's checkpoints
    go to its own run folder, its dumps nowhere until given), and a line for each."""
    tree, parent, lines = config_to_dict(new), config_to_dict(base), []
    for key in _OWN_FOLDERS:
        section, leaf = key.split(".")
        value = tree[section][leaf]
        if value is not None and value == parent[section][leaf]:
            tree[section][leaf] = None
            lines.append(f"{key}={value} is the parent's: not the fork's (give it a folder of "
                         f"its own to set it)")
    return (load_config(None, [], base=tree), lines) if lines else (new, [])


def fork_run(cli: Config, at: int, new_run: str, overrides: list[str]) -> int:
    """``rlbus fork``: the exit code (0 forked, 1 the rebuilt model differs, 2 refused)."""
    from rlbus.replay import Outcome, on_the_log

    if (why := _refusal(overrides)) is not None:
        print(f"rlbus fork: error: {why}", file=sys.stderr)
        return 2
    return on_the_log(cli, "rlbus fork", lambda url, log: Outcome(
        _fork(url, cli, log, at, new_run, overrides), 0))


def _fork(url: str, cli: Config, log: Any, at: int, new_run: str, overrides: list[str]
          ) -> list[str]:
    from rlbus.replay import (
        ReplayError,
        compare_published,
        run_config,
        start_model,
        trained_samples,
    )
    from trainer.runfiles import RunFiles

    run_id = cli.run.id or ""
    base = run_config(cli, log.config_at(at))
    try:
        new = load_config(None, [*overrides, f"run.id={new_run}"], base=config_to_dict(base))
        new, moved = _own_folders(base, new)
    except Exception as exc:  # ConfigError: one line naming the key
        raise ReplayError(str(exc)) from None
    if not asyncio.run(_log_is_empty(url, new_run)):
        raise ReplayError(f"run {new_run!r} already has a log at this Redis: fork into a new "
                          f"run id")
    folder = checkpoint_dir(new, new_run)
    if (folder / checkpoint_name(at)).exists():
        raise ReplayError(f"{folder / checkpoint_name(at)} exists: fork into a new run id "
                          f"(or remove {local_root(new, new_run)})")
    parent = asyncio.run(_parent_at(url, run_id, events_dir(cli, run_id), at))
    if parent is None:
        raise ReplayError(f"step {at} is not a finished step of run {run_id}")
    walk = start_model(base, log, at, RunFiles(base, run_id).locate, False)
    recs = [log.steps[s] for s in range(walk.start + 1, at + 1)]
    samples = trained_samples(url, run_id, record_dir(base, run_id), recs)
    for rec in recs:
        walk.replayer.apply(rec, group_in_order(rec, samples))
    compared = compare_published(walk, log, at)
    if compared is not None and not compared[1]:
        raise ReplayError(f"{compared[0]}: not forking from a model the run did not have", 1)
    learner = walk.replayer.learner
    written = write_checkpoint(folder, at, learner.version, learner.checkpoint_payload, b"")
    pt = str(written.path)
    files = {written.path.name: written.files[written.path.name]}
    state, dropped = _fork_state(parent.state, at, new.trainer.total_training_steps, pt, files)
    changed = [o for o in overrides if not o.lstrip("+~").startswith(("run.", "redis."))]
    digest = walk.replayer.digest(False)
    forked = RunForked(run_id=new_run, parent=run_id, step=at, parent_position=parent.position,
                       checkpoint=pt, overrides=changed, weights_sha256=digest,
                       dropped_tickets=dropped)
    position, last_finished = asyncio.run(_write_log(url, new, new_run, parent, forked))
    snapshot = Snapshot(state=state, position=position, last_finished_id=last_finished)
    atomic_write(written.path.with_suffix(".state"), msgspec.msgpack.encode(snapshot))
    lines = [f"run {new_run} forked from run {run_id} after step {at} "
             f"({' '.join(changed) or 'no change'}): checkpoint {pt}", *moved]
    if compared is not None:
        lines.append(compared[0])
    if dropped:
        lines.append(f"{len(dropped)} tickets open in {run_id} at step {at} are not carried "
                     f"over ({', '.join(dropped[:8])}{' ...' if len(dropped) > 8 else ''})")
    lines.append(f"go on with: rlbus up run.id={new_run} run.output_dir={new.run.output_dir}")
    return lines


async def _write_log(url: str, cfg: Config, run_id: str, parent: ParentAt, forked: RunForked
                     ) -> tuple[str, str]:
    """NEW's log: RunStarted, the parent's StepFinished events, RunForked; the ids of the
    RunForked and of the last StepFinished."""
    bus = Bus.from_url(url)
    keys = RunKeys(run_id)
    try:
        tree = config_to_dict(cfg)
        await bus.publish(keys.events, RunStarted(run_id=run_id, config=tree))
        last = ""
        for msg in parent.finished:
            last = await bus.publish(keys.events, msg)
        position = await bus.publish(keys.events, forked)
        await bus.publish(RUNS_STREAM, RunStarted(run_id=run_id, config=tree))
        return position, last
    finally:
        await bus.close()
