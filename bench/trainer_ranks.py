"""Trainer step time on 1 and on N ranks, side by side, in one run:
``python bench/trainer_ranks.py [--ranks 2] [--steps 6] [--mixed] [--model DIR] [KEY=VALUE ...]``.

Each configuration is a process of its own (rank 0, with its ranks started as the trainer
starts them) that trains the same synthetic steps through the trainer's RankedStep, one
torch thread per rank, and reports the mean time of a step after the first. The model is
the chat demo's Hugging Face model (built under outputs/chatdemo when missing), or
``--model DIR``.

On a CPU box the N ranks share its cores: with N cores the ideal is a step N times shorter
(each rank trains 1/N of the rows), so the figure printed is the *efficiency*
t_1 / (N x t_N), 1.0 meaning the collectives cost nothing. Run it on an idle machine.

N ranks run twice: with ``trainer.balance_batch`` (rows split by tokens, the default) and
without (every N-th row). ``--mixed`` draws each response's length from a long tail (16 to
256 tokens) and packs micro-batches by tokens (``use_dynamic_bsz``, 512 per micro-batch),
where the split decides how many micro-batches the busiest rank runs; without it every
response has 96 tokens and both splits are the same.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


MIXED = ["trainer.use_dynamic_bsz=true", "trainer.max_token_len=512"]


def _one(args: argparse.Namespace, ranks: int, *extra: str) -> dict[str, float]:
    mixed = ["--mixed", *MIXED] if args.mixed else []
    cmd = [sys.executable, __file__, "--child", str(ranks), "--steps", str(args.steps),
           "--model", args.model, *mixed, *args.overrides, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{ranks} rank(s) failed:\n{res.stderr[-3000:]}")
    out: dict[str, float] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def _groups(step: int, n_groups: int, n: int, prompt: int, vocab: int, mixed: bool) -> list:
    import numpy as np

    from runschema.messages import Array, Sample

    rng = np.random.default_rng(step)

    def sample(g: int, i: int) -> Sample:
        response = int(rng.choice([16, 32, 64, 256], p=[0.4, 0.3, 0.2, 0.1])) if mixed else 96
        return Sample(sample_id=f"{step}/{g}/{i}", ticket_id=f"{step}/{g}", prompt_id="",
                      index=i, n=n,
                      prompt_tokens=Array.of(rng.integers(3, vocab, prompt).astype(np.int32)),
                      response_tokens=Array.of(rng.integers(3, vocab, response)
                                               .astype(np.int32)),
                      logprobs=Array.of(-rng.random(response).astype(np.float32)),
                      reward=float((g + i) % 2), min_version=step - 1, max_version=step - 1)

    return [[sample(g, i) for i in range(n)] for g in range(n_groups)]


def child(ranks: int, steps: int, model: str, mixed: bool, overrides: list[str]) -> None:
    from runconfig import config_to_dict, load_config
    from trainer.learner import Learner, make_optimizer
    from trainer.ranks import rank_zero_group, spawn_ranks, wait_ranks
    from trainer.rowsplit import balanced_rows, rank_loads, strided_rows

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
    times, busiest = [], []
    for step in range(1, steps + 1):
        learner.version = step - 1
        groups = _groups(step, tc.ppo_mini_batch_size, cfg.rollout.n, 48, vocab, mixed)
        t = time.perf_counter()
        ranked = learner.step()
        ranked.add(groups)
        ranked.train()
        ranked.finish()
        times.append(time.perf_counter() - t)
        tokens = [len(s.prompt_tokens) + len(s.response_tokens) for g in groups for s in g]
        split = (balanced_rows(tokens, ranks) if tc.balance_batch
                 else strided_rows(len(tokens), ranks))
        busiest.append(max(rank_loads(tokens, split)))
    t = time.perf_counter()
    learner.snapshot()
    gather_s = time.perf_counter() - t
    learner.stop_ranks()
    wait_ranks(procs, 60)
    group.close()
    later = times[1:]
    print(json.dumps({"step_s": sum(later) / len(later), "first_s": times[0],
                      "snapshot_s": gather_s, "busiest": sum(busiest) / len(busiest)}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--model", default=str(ROOT / "outputs" / "chatdemo" / "model"))
    p.add_argument("--child", type=int)
    p.add_argument("--mixed", action="store_true", help="long-tailed response lengths")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.child is not None:
        child(args.child, args.steps, args.model, args.mixed, args.overrides)
        return
    if not (Path(args.model) / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "tasks.chatdemo", str(Path(args.model).parent)],
                       check=True, cwd=ROOT)
    one = _one(args, 1)
    many = _one(args, args.ranks)
    strided = _one(args, args.ranks, "trainer.balance_batch=false")
    eff = one["step_s"] / (args.ranks * many["step_s"])
    lengths = "16-256 tokens (long tail), micro-batches of <= 512" if args.mixed else "96 tokens"
    print(f"model {args.model}; {args.steps} steps of 8 prompts x 8 responses "
          f"(48 + {lengths}), one thread per rank")
    print(f"1 rank:  step {one['step_s']:.3f} s  (snapshot {one['snapshot_s']:.3f} s)")
    print(f"{args.ranks} ranks: step {many['step_s']:.3f} s  (snapshot gathered "
          f"{many['snapshot_s']:.3f} s); busiest rank {many['busiest']:.0f} tokens/step")
    print(f"{args.ranks} ranks, balance_batch=false: step {strided['step_s']:.3f} s; busiest "
          f"rank {strided['busiest']:.0f} tokens/step")
    print(f"speed-up {one['step_s'] / many['step_s']:.2f}x; efficiency t1 / ({args.ranks} x "
          f"t{args.ranks}) = {eff:.2f} (1.0: the collectives cost nothing); balanced vs "
          f"strided {strided['step_s'] / many['step_s']:.2f}x")


if __name__ == "__main__":
    main()
