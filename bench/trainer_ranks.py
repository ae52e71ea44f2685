"""Trainer step time on 1 and on N ranks, side by side, in one run:
``python bench/trainer_ranks.py [--ranks 2] [--steps 6] [--model DIR] [KEY=VALUE ...]``.

Each configuration is a process of its own (rank 0, with its ranks started as the trainer
starts them) that trains the same synthetic steps through the trainer's RankedStep, one
torch thread per rank, and reports the mean time of a step after the first. The model is
the chat demo's Hugging Face model (built under outputs/chatdemo when missing), or
``--model DIR``.

On a CPU box the N ranks share its cores: with N cores the ideal is a step N times shorter
(each rank trains 1/N of the rows), so the figure printed is the *efficiency*
t_1 / (N x t_N), 1.0 meaning the collectives cost nothing. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _one(args: argparse.Namespace, ranks: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", str(ranks), "--steps", str(args.steps),
           "--model", args.model, *args.overrides]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{ranks} rank(s) failed:\n{res.stderr[-3000:]}")
    out: dict[str, float] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def _groups(step: int, n_groups: int, n: int, prompt: int, response: int, vocab: int) -> list:
    import numpy as np

    from bus.messages import Array, Sample

    rng = np.random.default_rng(step)
    return [[Sample(sample_id=f"{step}/{g}/{i}", ticket_id=f"{step}/{g}", prompt_id="",
                    index=i, n=n,
                    prompt_tokens=Array.of(rng.integers(3, vocab, prompt).astype(np.int32)),
                    response_tokens=Array.of(rng.integers(3, vocab, response).astype(np.int32)),
                    logprobs=Array.of(-rng.random(response).astype(np.float32)),
                    reward=float((g + i) % 2), min_version=step - 1, max_version=step - 1)
             for i in range(n)] for g in range(n_groups)]


def child(ranks: int, steps: int, model: str, overrides: list[str]) -> None:
    from runconfig import config_to_dict, load_config
    from trainer.learner import Learner, make_optimizer
    from trainer.ranks import rank_zero_group, spawn_ranks, wait_ranks

    cfg = load_config(None, ["model.kind=hf", f"model.path={model}", "trainer.threads=1",
                             "trainer.ppo_mini_batch_size=8", "rollout.n=8",
                             "async_training.require_batches=1",
                             f"trainer.n_gpus_per_node={ranks}", *overrides])
    tc = cfg.trainer
    group = rank_zero_group(tc)
    procs = []
    if group.spec is not None:
        procs = spawn_ranks(range(1, ranks), ranks, ranks, group.spec.addr, group.spec.port,
                            device=tc.device, timeout_s=tc.dist_timeout_s)
        group.open()
        group.send("config", (config_to_dict(cfg), 0))
    learner = Learner(cfg, group)
    learner.build()
    learner.optimizer, learner.scheduler = make_optimizer(learner.policy.parameters(), tc)
    vocab = int(learner.policy.model.config.vocab_size)
    times = []
    for step in range(1, steps + 1):
        learner.version = step - 1
        groups = _groups(step, tc.ppo_mini_batch_size, cfg.rollout.n, 48, 96, vocab)
        t = time.perf_counter()
        ranked = learner.step()
        ranked.add(groups)
        ranked.train()
        ranked.finish()
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    learner.snapshot()
    gather_s = time.perf_counter() - t
    learner.stop_ranks()
    wait_ranks(procs, 60)
    group.close()
    later = times[1:]
    print(json.dumps({"step_s": sum(later) / len(later), "first_s": times[0],
                      "snapshot_s": gather_s}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--model", default=str(ROOT / "outputs" / "chatdemo" / "model"))
    p.add_argument("--child", type=int)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.child is not None:
        child(args.child, args.steps, args.model, args.overrides)
        return
    if not (Path(args.model) / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "tasks.chatdemo", str(Path(args.model).parent)],
                       check=True, cwd=ROOT)
    one = _one(args, 1)
    many = _one(args, args.ranks)
    eff = one["step_s"] / (args.ranks * many["step_s"])
    print(f"model {args.model}; {args.steps} steps of 8 prompts x 8 responses "
          f"(48 + 96 tokens), one thread per rank")
    print(f"1 rank:  step {one['step_s']:.3f} s  (snapshot {one['snapshot_s']:.3f} s)")
    print(f"{args.ranks} ranks: step {many['step_s']:.3f} s  (snapshot gathered "
          f"{many['snapshot_s']:.3f} s)")
    print(f"speed-up {one['step_s'] / many['step_s']:.2f}x; efficiency t1 / ({args.ranks} x "
          f"t{args.ranks}) = {eff:.2f} (1.0: the collectives cost nothing)")


if __name__ == "__main__":
    main()
