"""``rlbus retrain --from RUN [--steps A-B] [--name NAME] [KEY=VALUE ...]``: train a copy of
a run's model as it was before step A on exactly the samples the run trained in steps A..B,
with other trainer settings (clip ratios, KL, entropy, zero_adv, lr, ...): the controlled
comparison of losses on identical data, in one process.

The model before step A is rebuilt as ``rlbus replay`` rebuilds it (the newest intact
checkpoint at or before A-1 and the steps after it, with the run's own config); then steps
A..B are trained with the overrides. Only ``trainer.*`` keys may change: a key that changes
the samples (rollout, data, reward) or the model cannot be retrained on the recorded samples
and is refused (exit 2) naming it; ``rlbus fork`` is for those.

It writes ``run.output_dir/RUN/retrain/NAME/tensorboard/{run,NAME}``: the run's own metrics
of steps A..B from its log and the retrain's (the update's metrics, verl's names), so one
TensorBoard folder overlays them; and ``summary.json``. With no override it must reproduce
the run's weights at B: the model is compared with the publication after B (when B is a
version boundary), as replay compares.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from runconfig import Config, config_to_dict, load_config
from runconfig.paths import local_root, record_dir
from trainer.replay import group_in_order

__all__ = ["changed_keys", "parse_steps", "retrain_run"]

_STEPS = re.compile(r"^(\d+)(?:-(\d+))?$")
_REFUSED_UNDER_TRAINER = ("trainer.device", "trainer.nnodes", "trainer.n_gpus_per_node",
                          "trainer.seed")


def parse_steps(spec: str | None, last: int) -> tuple[int, int]:
    """``A-B`` (or ``A``: A to the run's last step; None: 1 to the last) as a step range."""
    if spec is None:
        return 1, last
    m = _STEPS.match(spec.strip())
    if m is None:
        raise ValueError(f"--steps {spec!r}: give A-B or A (steps of the run, 1-based)")
    first, end = int(m[1]), int(m[2]) if m[2] else last
    if not 1 <= first <= end <= last:
        raise ValueError(f"--steps {spec!r}: the run finished steps 1-{last}")
    return first, end


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def changed_keys(before: Config, after: Config) -> dict[str, tuple[Any, Any]]:
    """The keys whose value differs, ``{key: (before, after)}``."""
    a, b = _flat(config_to_dict(before)), _flat(config_to_dict(after))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _refusal(changed: dict[str, tuple[Any, Any]]) -> str | None:
    for key in changed:
        if key.startswith(("run.", "redis.")):
            continue  # where the data lives: not the job
        if not key.startswith("trainer.") or key in _REFUSED_UNDER_TRAINER:
            return (f"{key}: retrain trains on the samples the run recorded, with its model; "
                    f"only the trainer's settings (trainer.*, verl's actor keys) may change "
                    f"(use rlbus fork to go on from a step with other samples)")
    return None


def _name_of(changed: dict[str, tuple[Any, Any]]) -> str:
    parts = [f"{k.rsplit('.', 1)[-1]}={v[1]}" for k, v in changed.items()
             if k.startswith("trainer.")]
    text = ",".join(parts) or "same"
    return re.sub(r"[^A-Za-z0-9_.=,-]", "_", text)[:80]


def _sink(folder: Path) -> Any:
    from metrics_logger.app import TensorBoardSink

    return TensorBoardSink(folder)


def retrain_run(cli: Config, overrides: list[str], steps: str | None, name: str | None) -> int:
    """``rlbus retrain``: the exit code (0 done, 1 the reproduction differs, 2 refused)."""
    from rlbus.replay import Outcome, ReplayError, on_the_log

    def body(url: str, log: Any) -> Outcome:
        try:
            first, last = parse_steps(steps, log.last_step)
        except ValueError as exc:
            raise ReplayError(str(exc)) from None
        return Outcome(*_retrain(url, cli, log, overrides, first, last, name))

    return on_the_log(cli, "rlbus retrain", body)


def _retrain(url: str, cli: Config, log: Any, overrides: list[str], first: int, last: int,
             name: str | None) -> tuple[list[str], int]:
    from rlbus.replay import ReplayError, compare_published, run_config, start_model
    from rlbus.replay import trained_samples as samples_of
    from trainer.runfiles import RunFiles

    run_id = cli.run.id or ""
    base = run_config(cli, log.config_at(first - 1))
    try:
        new = load_config(None, overrides, base=config_to_dict(base))
    except Exception as exc:  # ConfigError: one line naming the key
        raise ReplayError(str(exc)) from None
    changed = changed_keys(base, new)
    refused = _refusal(changed)
    if refused is not None:
        raise ReplayError(refused)
    build = new if new.trainer.use_kl_loss and not base.trainer.use_kl_loss else None
    began = time.perf_counter()
    walk = start_model(base, log, first - 1, RunFiles(base, run_id).locate, False, build) \
        if first > 1 else start_model(base, log, 1, RunFiles(base, run_id).locate, True, build)
    recs = [log.steps[s] for s in range(walk.start + 1, last + 1)]
    samples = samples_of(url, run_id, record_dir(base, run_id), recs)
    for rec in recs[: max(0, first - 1 - walk.start)]:
        walk.replayer.apply(rec, group_in_order(rec, samples))
    walk.replayer.use(new)
    label = name or _name_of(changed)
    out = local_root(cli, run_id) / "retrain" / label
    theirs, mine = _sink(out / "tensorboard" / run_id), _sink(out / "tensorboard" / label)
    now = time.time()
    curves: dict[int, dict[str, float]] = {}
    for rec in recs[max(0, first - 1 - walk.start):]:
        metrics = walk.replayer.apply(rec, group_in_order(rec, samples))
        curves[rec.step] = metrics
        mine.write(rec.step, metrics, now)
        parent = log.metrics.get(rec.step)
        if parent:
            theirs.write(rec.step, parent, now)
    for sink in (theirs, mine):
        sink.close()
    settings = {k: v for k, v in changed.items() if k.startswith("trainer.")}
    said = ", ".join(f"{k}={v[1]}" for k, v in settings.items()) or "the run's own settings"
    start = f"the checkpoint of step {walk.start}" if walk.start else "the config's model"
    lines = [f"retrained steps {first}-{last} of run {run_id} with {said}, from the model "
             f"before step {first} (rebuilt from {start})"]
    code = 0
    c = compare_published(walk, log, last)
    if c is not None:
        lines.append(c[0])
        if not settings:
            code = 0 if c[1] else 1  # the run's own settings must reproduce its weights
    summary = {"run": run_id, "steps": [first, last], "changed": settings,
               "model_sha256": walk.replayer.digest(False), "metrics": curves,
               "seconds": round(time.perf_counter() - began, 3)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    lines.append(f"written: {out / 'tensorboard'} (the run's curves and this retrain's, "
                 f"side by side) and {out / 'summary.json'}")
    return lines, code
