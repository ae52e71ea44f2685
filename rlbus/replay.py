"""``rlbus replay``: rebuild a run's model after step K on this machine and compare it with
the weights the run published (trainer.replay holds the arithmetic; this is its shell).

It reads the run's events (the archive, then the stream: runtime.history), takes the config
the run recorded, loads the newest intact checkpoint at or before K (files checked against
their CheckpointSaved digests; a corrupt one is passed over, said in one line), re-applies
each later step on the samples its StepFinished names, read from the run's record
(trainer.record) or else from the samples stream, and hashes the model at every version
boundary it passes (the run published weights there). ``--check`` walks every step from the
model the config builds (step 0) and compares at every boundary, naming the first step that
differs.

Exit codes: 0 the model matches every publication compared (or none could be compared: said
so), 1 a mismatch (the first one named), 2 the replay cannot be done (a step the run did
not finish, samples neither in the record nor in the stream, no events).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from bus import Bus, RunKeys
from runconfig import Config, load_config
from runconfig.paths import events_dir, record_dir
from runschema.messages import Sample, decode
from runtime.history import find_archive, read_history
from storage.record import RecordCorrupt, read_rows
from trainer.replay import (
    TOLERANCE,
    NotReplayable,
    Replayer,
    RunLog,
    first_start,
    group_in_order,
    plan,
    state_difference,
)
from trainer.state import StepRecord

__all__ = [
    "Outcome",
    "ReplayError",
    "Walk",
    "compare_published",
    "fetch_record",
    "on_the_log",
    "read_run_log",
    "replay_run",
    "run_config",
    "start_model",
    "trained_samples",
]


class ReplayError(Exception):
    """One line to print; the exit code."""

    def __init__(self, line: str, code: int = 2) -> None:
        super().__init__(line)
        self.code = code


class Outcome(NamedTuple):
    """What a replay found: lines to print and the exit code."""

    lines: list[str]
    code: int


def _say(line: str) -> None:
    print(line, flush=True)


async def read_run_log(url: str, run_id: str, archive: Path) -> RunLog:
    bus = Bus.from_url(url)
    keys = RunKeys(run_id)
    log = RunLog()
    try:
        folder = await find_archive(bus, keys, archive)
        async for entry in read_history(bus, keys.events, folder or archive):
            log.take(entry.msg)
    finally:
        await bus.close()
    return log


def _from_record(folder: Path, steps: set[int]) -> dict[str, Sample]:
    """The samples of ``steps`` the record holds, by samples-stream entry id."""
    found: dict[str, Sample] = {}
    for row in read_rows(folder, steps=steps, columns=["entry_id", "raw", "verdict"]):
        if row["verdict"] != "trained":
            continue
        msg = decode(row["raw"])
        if isinstance(msg, Sample):
            found[row["entry_id"]] = msg
    return found


async def _from_stream(url: str, run_id: str, ids: list[str]) -> dict[str, Sample]:
    bus = Bus.from_url(url)
    try:
        found = await bus.read_ids(RunKeys(run_id).samples, ids)
    finally:
        await bus.close()
    return {eid: m for eid, m in found.items() if isinstance(m, Sample)}


def trained_samples(url: str, run_id: str, folder: Path, recs: list[StepRecord]
             ) -> dict[str, Sample]:
    """Every sample ``recs`` trained: the record's, then what the stream still holds."""
    try:
        found = _from_record(folder, {r.step for r in recs})
    except RecordCorrupt as exc:
        raise ReplayError(str(exc)) from None
    wanted = [eid for r in recs for eid in r.entry_ids if eid not in found]
    if wanted:
        found.update(asyncio.run(_from_stream(url, run_id, wanted)))
    for r in recs:
        if not r.entry_ids:
            raise ReplayError(f"step {r.step}: its StepFinished names no samples-stream entries "
                        f"(a log written before entry ids were recorded): not replayable")
        missing = [eid for eid in r.entry_ids if eid not in found]
        if missing:
            raise ReplayError(f"step {r.step}: {len(missing)} of its samples are neither in the "
                        f"run's record ({folder}) nor in the samples stream (first: "
                        f"{missing[0]})")
    return found


def run_config(cli: Config, recorded: dict[str, Any] | None) -> Config:
    from rlbus.runlog import recorded_config

    if recorded is None:
        raise ReplayError(f"run {cli.run.id}: its log holds no RunStarted (no config to "
                          f"replay with)")
    warnings: list[str] = []
    cfg = load_config(None, [], base=recorded_config(recorded, cli, warnings.append),
                      on_warning=warnings.append)
    return cfg


class Walk(NamedTuple):
    replayer: Replayer
    start: int
    skipped: list[str]


def start_model(cfg: Config, log: RunLog, target: int, locate: Callable[[str], str],
                oldest: bool, build: Config | None = None) -> Walk:
    """The model to replay from: the newest start that serves, or with ``oldest`` (--check)
    the oldest (the model built from the config: every step is walked). ``build``: the
    config to build the model with when not ``cfg`` (rlbus retrain: one with a KL reference
    the run had none of)."""
    p = plan(log, target)
    if oldest:
        p = p._replace(starts=p.starts[::-1])
    replayer, start, skipped = first_start(lambda: Replayer(cfg, build), log, p, locate)
    return Walk(replayer, start, skipped)


def compare_published(walk: Walk, log: RunLog, step: int) -> tuple[str, bool] | None:
    """The line and verdict of the comparison at ``step`` (None: no publication there)."""
    version = walk.replayer.version_at(step)
    published = None if version is None else log.published.get(version)
    if version is None or published is None:
        return None
    digest = walk.replayer.digest(published.manifest)
    same = digest == published.sha256
    word = "matches" if same else "DIFFERS from"
    return (f"step {step}: the model ({digest[:16]}) {word} weights version {version} as "
            f"published ({published.sha256[:16]})", same)


def exact_replay(cfg: Config, walk: Walk) -> bool:
    """Whether the replay can be bit for bit: the run trained on one rank and neither it
    (``trainer.device``) nor this replay on a GPU (kernels that may be nondeterministic)."""
    ranks = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    device = getattr(walk.replayer.learner.device, "type", "cpu")
    return ranks == 1 and device == "cpu" and not str(cfg.trainer.device).startswith("cuda")


def compare_checkpoint(walk: Walk, log: RunLog, step: int, cfg: Config,
                       locate: Callable[[str], str], start: dict[str, Any]
                       ) -> tuple[str, bool, Replayer] | None:
    """The line and verdict of comparing the model with the checkpoint of ``step`` within
    :data:`trainer.replay.TOLERANCE` of the run's move since the window's ``start``
    weights, and that checkpoint loaded (None: no checkpoint of that step loads)."""
    if step not in log.checkpoints:
        return None
    path, files = log.checkpoints[step]
    other = Replayer(cfg)
    if other.load(locate(path), files) is not None:
        return None
    other.step, other.train_s = step, walk.replayer.train_s
    d = state_difference(walk.replayer.weights(), other.weights(), start)
    word = "within" if d.within else "OUTSIDE"
    return (f"step {step}: the model is {word} tolerance of the run's checkpoint of step "
            f"{step}: {d.distance:.3g} from it, {100 * d.ratio:.3g}% of the run's move over "
            f"the window ({d.update:.3g}; tolerance {100 * TOLERANCE:g}%)", d.within, other)


def _walk(url: str, cli: Config, log: RunLog, target: int, every: bool) -> Outcome:
    cfg = run_config(cli, log.config_at(target))
    from trainer.runfiles import RunFiles

    files = RunFiles(cfg, cli.run.id or "")
    began = time.perf_counter()
    walk = start_model(cfg, log, target, files.locate, every)
    lines = [f"skipped: {why}" for why in walk.skipped]
    where = (f"the checkpoint of step {walk.start}" if walk.start
             else "the model built from the config (step 0)")
    recs = [log.steps[s] for s in range(walk.start + 1, target + 1) if s in log.steps]
    if len(recs) != target - walk.start:
        gap = next(s for s in range(walk.start + 1, target + 1) if s not in log.steps)
        raise ReplayError(f"step {gap} has no StepFinished in the log: not replayable")
    samples = trained_samples(url, cli.run.id or "", record_dir(cfg, cli.run.id or ""), recs)
    lines.append(f"replaying steps {walk.start + 1}-{target} from {where}")
    exact = exact_replay(cfg, walk)
    if not exact:
        return _walk_within_tolerance(walk, log, recs, samples, target, every, cfg,
                                      files.locate, lines, began)
    code, compared = 0, 0
    if every and (c := compare_published(walk, log, walk.start)) is not None:
        compared += 1
        lines.append(c[0])
    for rec in recs:
        walk.replayer.apply(rec, group_in_order(rec, samples))
        if not (every or rec.step == target or _last_boundary(walk, rec.step, target)):
            continue
        c = compare_published(walk, log, rec.step)
        if c is None:
            continue
        compared += 1
        lines.append(c[0])
        if not c[1]:
            code = 1
            if every:
                lines.append(f"first step that differs: {rec.step}")
                break
    lines += _tail(walk, log, recs, compared, target, time.perf_counter() - began, cfg)
    return Outcome(lines, code)


def _walk_within_tolerance(walk: Walk, log: RunLog, recs: list[StepRecord],
                           samples: dict[str, Sample], target: int, every: bool, cfg: Config,
                           locate: Callable[[str], str], lines: list[str], began: float
                           ) -> Outcome:
    """A replay that cannot be bit for bit: compared within :data:`TOLERANCE` with the run's
    checkpoints of the steps it passes (the last one, or each with ``every``); the hashes of
    its publications are not expected to match and decide nothing. After each comparison the
    walk goes on from the run's checkpoint: each window between two checkpoints is held to
    the tolerance on its own (rounding differences grow over a trajectory, chaotically)."""
    code, compared = 0, 0
    last = max((s for s in log.checkpoints if walk.start < s <= target), default=None)
    start = walk.replayer.weights()
    for rec in recs:
        walk.replayer.apply(rec, group_in_order(rec, samples))
        if not (rec.step == last or (every and rec.step in log.checkpoints)):
            continue
        c = compare_checkpoint(walk, log, rec.step, cfg, locate, start)
        if c is None:
            continue
        compared += 1
        lines.append(c[0])
        walk = walk._replace(replayer=c[2])
        start = c[2].weights()
        if not c[1]:
            code = 1
            if every:
                lines.append(f"first checkpoint outside tolerance: step {rec.step}")
                break
    if not compared:
        lines.append(f"nothing to compare within tolerance: no checkpoint of steps "
                     f"{walk.start + 1}-{target} loads (replay --step to a checkpoint's step)")
    lines += _tail(walk, log, recs, compared or 1, target, time.perf_counter() - began, cfg)
    return Outcome(lines, code)


def _last_boundary(walk: Walk, step: int, target: int) -> bool:
    """Whether ``step`` is the last version boundary at or before ``target``."""
    trigger = walk.replayer.trigger
    return step == target - target % trigger


def _tail(walk: Walk, log: RunLog, recs: list[StepRecord], compared: int, target: int,
          took: float, cfg: Config) -> list[str]:
    ran = sum(log.durations.get(r.step, 0.0) for r in recs)
    lines = [f"step {target}: model sha256 {walk.replayer.digest(False)} (serialised state)"]
    if not compared:
        lines.append("nothing to compare: no weights were published at a step replayed "
                     "(trainer.trigger_parameter_sync_step, or the publications' events are "
                     "gone)")
    lines.append(f"replayed {len(recs)} steps in {walk.replayer.train_s:.2f} s of training "
                 f"({took:.2f} s in all); the run trained them in {ran:.2f} s")
    if not exact_replay(cfg, walk):
        ranks = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
        lines.append(f"note: the run trained on {ranks} rank(s) (trainer.device="
                     f"{cfg.trainer.device}), replayed on one {walk.replayer.learner.device}: "
                     f"not bit for bit (several ranks sum in another order; GPU kernels may be "
                     f"nondeterministic), so each window between two of the run's checkpoints "
                     f"is compared with the checkpoint at its end, within {100 * TOLERANCE:g}% "
                     f"of the run's move over it (docs/operations.md)")
    return lines


def fetch_record(cfg: Config, run_id: str, prog: str) -> None:
    """On a remote run.storage, the record segments the trainer mirrored there that this
    node lacks (a storage that fails is a warning: what is local is read)."""
    from runtime.events_archive import fetch_for_reading
    from storage.run_storage import StorageError

    try:
        fetch_for_reading(cfg, run_id, record=True)
    except StorageError as exc:
        print(f"{prog}: warning: the run's record could not be fetched from run.storage "
              f"({exc})", file=sys.stderr)


def on_the_log(cli: Config, prog: str, body: Callable[[str, RunLog], Outcome]) -> int:
    """The shell of replay, retrain and fork: the run's archive and record fetched from
    run.storage where this node lacks them, its Redis opened (the embedded server's saved
    data, or redis.url), its log folded, ``body(url, log)`` run; its lines printed and its
    code returned, or one line and exit 2 (1 for a run with no events) for what it cannot
    do."""
    from rlbus.inspect import _fetch_archive
    from rlbus.launcher import RunDataMissing, redis_for_reading

    run_id = cli.run.id or ""
    _fetch_archive(cli, run_id)
    fetch_record(cli, run_id, prog)
    try:
        with redis_for_reading(cli) as url:
            log = asyncio.run(read_run_log(url, run_id, events_dir(cli, run_id)))
            if not log.configs:
                raise ReplayError(f"run {run_id!r} has no events at this Redis", 1)
            outcome = body(url, log)
    except (RunDataMissing, NotReplayable) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except ReplayError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.code
    for line in outcome.lines:
        _say(line)
    return outcome.code


def replay_run(cli: Config, step: int | None, check: bool) -> int:
    """``rlbus replay``: print what the replay found; the exit code."""
    return on_the_log(cli, "rlbus replay", lambda url, log: _walk(
        url, cli, log, log.last_step if step is None else step, check))
