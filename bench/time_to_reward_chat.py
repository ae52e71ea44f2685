"""Wall time until validation reward >= target on the chat demo: `rlbus up` vs in-process.

The verl user's job of ``configs/chat_demo.yaml`` (tasks/chatdemo.py: a tiny HF model with
its chat template, parquet data, a reward file with verl's signature), both sides on the same
files, seed and hyper-parameters, one after the other in one invocation, each process tree
stopped before the next starts:

- rlbus: ``rlbus up --config configs/chat_demo.yaml`` (embedded Redis, trainer, rollouter,
  reward pool, validation on the bus every ``--every`` weight versions), timed from launch
  until the progress line of the first validation whose val-core reward >= target;
- in-process: ``bench/sync_grpo_chat.py`` (generate -> reward -> update in one process,
  greedy validation every ``--every`` steps), timed from launch until it prints that it
  reached the target.

Prints both times, the version/step each needed, and the ratio rlbus / in-process.

    .venv/bin/python bench/time_to_reward_chat.py [--target 0.9] [--seeds 0 1 2] [--every 5]

``--engines``: instead, ``rlbus up`` with ``rollout.name=vllm`` against the built-in engine
(needs ``make vllm``), each timed from launch and from its first step; ``--set KEY=VALUE
...`` adds overrides to both.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.time_to_reward import _watch
from tasks.chatdemo import build_demo

__all__ = ["main"]

VAL_LINE = re.compile(r"validation v(\d+) \(step \d+\): val-core/\S+/reward/mean@1 ([0-9.]+)")
REACHED = re.compile(r"reached [0-9.]+ at step (\d+)")


def _rlbus(root: Path, seed: int, target: float, every: int, out: Path,
           engine: str = "hf", extra: tuple[str, ...] = ()) -> tuple:
    def found(line: str) -> int | None:
        m = VAL_LINE.search(line)
        return int(m.group(1)) if m and float(m.group(2)) >= target else None

    cmd = [sys.executable, "-m", "rlbus", "up", "--config", "configs/chat_demo.yaml",
           f"data.train_files={root / 'train.parquet'}", f"data.val_files={root / 'val.parquet'}",
           f"custom_reward_function.path={root / 'reward.py'}",
           f"actor_rollout_ref.model.path={root / 'model'}", f"run.output_dir={out}",
           f"trainer.default_local_dir={out / 'ckpt'}", "trainer.save_freq=0",
           "trainer.total_training_steps=400", f"trainer.test_freq={every}",
           "trainer.checkpoint_contents=[model,optimizer,extra]", "trainer.logger=[console]",
           f"trainer.seed={seed}", f"rollout.seed={seed}",
           f"actor_rollout_ref.rollout.name={engine}", *extra]
    return _watch(cmd, found, 900)


def _inprocess(root: Path, seed: int, target: float, every: int) -> tuple:
    def found(line: str) -> int | None:
        m = REACHED.search(line)
        return int(m.group(1)) if m else None

    cmd = [sys.executable, "bench/sync_grpo_chat.py", "--root", str(root), "--seed", str(seed),
           "--target", str(target), "--val-every", str(every), "--steps", "400"]
    return _watch(cmd, found, 900)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--every", type=int, default=5, help="validation every N versions/steps")
    p.add_argument("--engines", action="store_true",
                   help="rlbus up with rollout.name=vllm vs the built-in engine instead")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="with --engines: overrides for both runs (e.g. "
                        "async_training.staleness_threshold=0)")
    args = p.parse_args(argv)
    if args.engines:
        return _engines(args.seeds, args.target, args.every, tuple(args.set))
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            root = build_demo(Path(tmp) / f"files-{seed}", seed=seed)
            r_s, r_v, _ = _rlbus(root, seed, args.target, args.every, Path(tmp) / f"r{seed}")
            i_s, i_v, _ = _inprocess(root, seed, args.target, args.every)
            ratio = r_s / i_s if r_s and i_s else None
            if ratio is not None:
                ratios.append(ratio)
            print(f"seed {seed}: rlbus {r_s and round(r_s, 1)} s (version {r_v}), in-process "
                  f"{i_s and round(i_s, 1)} s (step {i_v}), ratio "
                  f"{'n/a' if ratio is None else f'{ratio:.2f}'}", flush=True)
    if ratios:
        print(f"median ratio rlbus / in-process: {statistics.median(ratios):.2f} "
              f"over {len(ratios)} seed(s)")
    return 0 if ratios else 1


def _engines(seeds: list[int], target: float, every: int, extra: tuple[str, ...] = ()) -> int:
    """The same job through ``rlbus up`` with vLLM and with the built-in engine, one after
    the other: seconds to the target (from launch, the engine's start-up included) and from
    the first step line (generation and training alone)."""
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            root = build_demo(Path(tmp) / f"files-{seed}", seed=seed)
            got = {engine: _rlbus(root, seed, target, every, Path(tmp) / f"{engine}{seed}",
                                  engine, extra) for engine in ("vllm", "hf")}
            for engine, (secs, version, first) in got.items():
                after = secs - first if secs and first else None
                print(f"seed {seed}: {engine}: {secs and round(secs, 1)} s to {target} "
                      f"(version {version}); first step at {first and round(first, 1)} s, "
                      f"{after and round(after, 1)} s after it", flush=True)
            (v, _, vf), (h, _, hf) = got["vllm"], got["hf"]
            if v and h and vf and hf:
                ratios.append((v - vf) / (h - hf))
                print(f"seed {seed}: vllm / built-in after the first step: {ratios[-1]:.2f}")
    if ratios:
        print(f"median vllm / built-in: {statistics.median(ratios):.2f} over {len(ratios)}")
    return 0 if ratios else 1


if __name__ == "__main__":
    raise SystemExit(main())
