"""Replaying a run's steps away from the run (``rlbus replay``): the model after step K
rebuilt from the newest intact checkpoint at or before it plus the samples the log says
each later step trained (the run's record, else the samples stream), and its hash compared
with the weights the run published.

The same arithmetic as a resume (trainer.resume.rebuild: ``Learner.update`` on the groups
of each step, in the order its StepFinished recorded), without Redis: the shell
(rlbus.replay) reads the log and the samples, this module folds and trains.

- :class:`RunLog`: what replay needs of a run's events, folded incrementally
  (``log.take(msg)``; pure).
- :func:`plan`: which checkpoints may start a replay to step K and which steps follow.
- :class:`Replayer`: one model, loaded and stepped (blocking; torch).

What replays bit for bit (docs/operations.md, "Replay and fork"): the same device type, the
same torch build and thread count, one rank where the run had one. The run's own steps on
several ranks, or on a GPU (nondeterministic kernels), replay within a tolerance only: the
shell says so.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from runconfig import Config
from runschema.messages import (
    CheckpointSaved,
    FileDigest,
    Message,
    RunForked,
    RunStarted,
    Sample,
    StepFinished,
    WeightsPublished,
)
from trainer.learner import Learner, make_optimizer
from trainer.resume import LOAD_ERRORS, checkpoint_fault
from trainer.state import StepRecord
from weights.transport import weights_digest

__all__ = ["TOLERANCE", "Difference", "NotReplayable", "Plan", "Published", "Replayer", "RunLog",
           "first_start", "group_in_order", "plan", "state_difference"]


class Published(NamedTuple):
    """The digest weights ``version`` were published under, and how it was computed."""

    sha256: str
    manifest: bool
    step: int


class RunLog(msgspec.Struct):
    """What a replay needs of a run's events: steps, checkpoints, publications, configs."""

    steps: dict[int, StepRecord] = {}
    durations: dict[int, float] = {}
    metrics: dict[int, dict[str, float]] = {}
    """Each step's metrics as its StepFinished said them (rlbus retrain draws them)."""
    checkpoints: dict[int, tuple[str, dict[str, FileDigest]]] = {}
    published: dict[int, Published] = {}
    configs: list[tuple[int, dict[str, Any]]] = []
    """Each RunStarted's config, with the last step finished before it."""
    last_step: int = 0
    forked: tuple[str, int] | None = None
    """``(parent run, step)`` when the run was forked (rlbus fork): its steps up to there
    are the parent's."""

    def take(self, msg: Message) -> None:
        """Fold one event (log order)."""
        match msg:
            case RunStarted(config=config):
                self.configs.append((self.last_step, config))
            case StepFinished():
                self.steps[msg.step] = StepRecord(msg.step, tuple(msg.sample_ids),
                                                  msg.param_version, tuple(msg.entry_ids))
                self.durations[msg.step] = msg.duration_s
                self.metrics[msg.step] = msg.metrics
                self.last_step = max(self.last_step, msg.step)
            case CheckpointSaved():
                self.checkpoints[msg.step] = (msg.path, dict(msg.files))
            case RunForked():  # a fork's first checkpoint is the one rlbus fork wrote
                self.checkpoints[msg.step] = (msg.checkpoint, {})
                self.forked = (msg.parent, msg.step)
            case WeightsPublished():
                ref = msg.manifest or msg.ref
                self.published[msg.version] = Published(ref.sha256, msg.manifest is not None,
                                                        msg.step)
            case _:
                pass

    def config_at(self, step: int) -> dict[str, Any] | None:
        """The config the trainer ran with when it trained the step after ``step``: the
        newest RunStarted written with ``step`` or fewer steps finished."""
        found = [cfg for before, cfg in self.configs if before <= step]
        return found[-1] if found else (self.configs[0][1] if self.configs else None)


class Plan(NamedTuple):
    """A replay to ``target``: the checkpoints that may start it, newest first (``(0,
    None)`` last: the model as built from the config), and the steps up to the target."""

    target: int
    starts: list[tuple[int, str | None]]

    def steps_after(self, start: int) -> list[int]:
        return list(range(start + 1, self.target + 1))


class NotReplayable(Exception):
    """What the log lacks for the replay asked (one line)."""


def plan(log: RunLog, target: int) -> Plan:
    """The replay of steps up to ``target``: every checkpoint of a step at or before it (the
    newest first), then the config's fresh model. :class:`NotReplayable` when the log has
    not finished that step, or lacks one of the steps a start would need."""
    if target < 1 or target > log.last_step:
        raise NotReplayable(f"step {target} is not a finished step of this run (its log "
                            f"finished steps 1-{log.last_step})")
    first = 0
    if log.forked is not None:
        parent, first = log.forked
        if target <= first:
            raise NotReplayable(f"step {target} is run {parent}'s: this run was forked from it "
                                f"after step {first} (replay it with --run {parent})")
    starts: list[tuple[int, str | None]] = [
        (s, log.checkpoints[s][0]) for s in sorted(log.checkpoints, reverse=True)
        if first <= s <= target]
    if log.forked is None:
        starts.append((0, None))  # the config's model: a fork has none of its own
    return Plan(target, starts)


def group_in_order(rec: StepRecord, by_entry: Mapping[str, Sample]) -> list[list[Sample]]:
    """Step ``rec``'s samples grouped by ticket, the groups in the order its StepFinished
    named them, each by index (as trainer.resume.replay_groups groups them)."""
    groups: dict[str, list[Sample]] = {}
    for eid in rec.entry_ids:
        s = by_entry[eid]
        groups.setdefault(s.ticket_id, []).append(s)
    return [sorted(g, key=lambda s: s.index) for g in groups.values()]


class Replayer:
    """One model of a run, built from its config on this machine (one rank), loaded from a
    checkpoint and stepped as the run stepped it (blocking)."""

    def __init__(self, cfg: Config, build: Config | None = None) -> None:
        self.cfg = cfg
        self.trigger = cfg.async_training.trigger_parameter_sync_step
        self.learner = Learner(build or cfg)
        self.learner.build()
        self.learner.optimizer, self.learner.scheduler = make_optimizer(
            self.learner.policy.parameters(), cfg.trainer)
        self.learner.cfg = cfg
        self.step = 0
        self.train_s = 0.0

    def use(self, cfg: Config) -> None:
        """Train the next steps with ``cfg``'s trainer settings (rlbus retrain: another loss
        on the same samples); a new ``trainer.lr`` becomes the schedule's base."""
        lr = cfg.trainer.lr
        if lr != self.cfg.trainer.lr and self.learner.scheduler is not None:
            scheduler = self.learner.scheduler
            scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
            for group, factor in zip(self.learner.optimizer.param_groups,
                                     [lam(scheduler.last_epoch) for lam in scheduler.lr_lambdas],
                                     strict=True):
                group["initial_lr"] = lr
                group["lr"] = lr * factor
        self.cfg = self.learner.cfg = cfg

    def load(self, path: str, files: dict[str, FileDigest]) -> str | None:
        """Load the checkpoint at ``path`` after checking its files against the digests its
        CheckpointSaved recorded; why it cannot serve (None: loaded)."""
        why = checkpoint_fault(self.learner, path, files)
        if why is not None:
            return why
        try:
            with warnings.catch_warnings():  # dcp shards into one process: what replay does
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                self.learner.load_checkpoint(path)
        except LOAD_ERRORS as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return f"{path} could not be loaded ({type(exc).__name__}: {first})"
        return None

    def apply(self, rec: StepRecord, groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
        """Train step ``rec`` on ``groups`` with the version the run held for it; the
        update's metrics."""
        began = time.perf_counter()
        self.learner.version = (rec.step - 1) // self.trigger
        metrics = self.learner.update(groups)
        self.step = rec.step
        self.train_s += time.perf_counter() - began
        return metrics

    def weights(self) -> dict[str, Any]:
        """A copy of the model's weights by name, whole, on the CPU (not views: the model
        trains on)."""
        return {k: v.detach().cpu().clone() for k, v in
                self.learner.checkpoint_state()[0].items()}

    def digest(self, manifest: bool) -> str:
        """The digest the model's weights would be published under now."""
        if manifest:
            return str(weights_digest(self.learner.snapshot()))
        return hashlib.sha256(self.learner.state_bytes()).hexdigest()

    def version_at(self, step: int) -> int | None:
        """The weights version published after ``step`` (None: no publication follows it)."""
        return step // self.trigger if step % self.trigger == 0 else None


TOLERANCE = 0.05
"""How far a replay that cannot be bit for bit (several ranks, a GPU) may land from the
run's checkpoint at the end of a window of steps, relative to how far the run moved in that
window: ``||replayed - run|| <= TOLERANCE * ||run - window's start||`` (L2 over every
weight). Rounding in another order makes two trajectories drift apart as they train
(measured on 2 CPU ranks: 0.0015% of the update over steps 1-20, 0.37% over 21-40); a wrong
sample, order or setting moves the update by its whole size."""


class Difference(NamedTuple):
    """How a replayed model differs from the run's: L2 of the difference, L2 of the run's
    update over the window, their ratio, and whether it is within :data:`TOLERANCE`."""

    distance: float
    update: float
    ratio: float
    within: bool


def state_difference(ours: Mapping[str, Any], theirs: Mapping[str, Any],
                     start: Mapping[str, Any]) -> Difference:
    """How far ``ours`` (the replayed weights) lies from ``theirs`` (the run's), against the
    run's move from ``start``; a missing or reshaped weight is never within."""
    same_names = set(ours) == set(theirs) == set(start)
    distance = update = 0.0
    for name, b in theirs.items():
        a, s = ours.get(name), start.get(name)
        if a is None or s is None or a.shape != b.shape or s.shape != b.shape:
            same_names = False
            continue
        b = b.detach().double()
        distance += float(((a.detach().double() - b) ** 2).sum())
        update += float(((b - s.detach().double()) ** 2).sum())
    distance, update = distance ** 0.5, update ** 0.5
    ratio = distance / update if update > 0 else (0.0 if distance == 0 else float("inf"))
    return Difference(distance, update, ratio, same_names and ratio <= TOLERANCE)


def first_start(replayer_for: Callable[[], Replayer], log: RunLog, p: Plan,
                locate: Callable[[str], str]) -> tuple[Replayer, int, list[str]]:
    """A model at the newest start of ``p`` that serves (its files verify and load), the
    step it is at, and why each newer one could not serve."""
    skipped: list[str] = []
    replayer = replayer_for()
    for step, path in p.starts:
        if path is None:
            return replayer, 0, skipped
        why = replayer.load(locate(path), log.checkpoints[step][1])
        if why is None:
            replayer.step = step
            return replayer, step, skipped
        skipped.append(why)
        replayer = replayer_for()  # a half-loaded model is not the one built
    raise NotReplayable(f"no checkpoint at or before step {p.target} serves: "
                        f"{'; '.join(skipped) or 'the log names none'}")
