"""In-process synchronous GRPO on the digits task: the reference learning curve.

generate with the current policy -> rewards -> group advantages -> PPO/Adam updates -> repeat.
Uses policy/, tasks/ and the trainer's own update function (trainer.update.grpo_update), so
if the distributed system learns slower than this, look at the system, not the math. The
defaults are the tuned hyper-parameters:

    task      digits, 4 digits ("1234>" -> "4321"), reward tasks.digits.digits_reward
    policy    tiny: d_model 64, 2 layers, 4 heads, max_len 32, dropout 0, init seed = --seed
    rollout   n 8, temperature 1.0, max_new_tokens 5 (max_digits + 1)
    step      32 prompts x 8 = 256 responses, 4 mini-batches of 8 prompts (64 responses),
              one Adam step each, one epoch; Adam lr 1e-3, grad-norm clip 1.0
    loss      ppo_clip_loss, clip 0.2 / 0.28, token mean, minus 0.01 x entropy; no KL
    old logp  the rollout log-probs, at the sampling temperature

Measured on 2 shared CPU cores, 1 thread, seed 0: reward 0.05 at step 1, 0.18 at 10, 0.32
at 30, 0.56 at 60, 0.81 at 70, 0.93 at 77 (6.0 s), 0.99 from step 100. Over seeds 0-9, 0.9
comes at step 65-86 in 7-10 s (about twice that with two runs sharing the cores). The
entropy bonus is optional (without it: steps 64-86, seeds 0-4).

Mixed lengths (--min-digits 3) learn the 3-digit half fast but then stall near 0.9 (about
half the 4-digit answers keep one wrong digit): with absolute positions the same position
needs a different prompt position per length, and the collapsed policy stops exploring.

    .venv/bin/python bench/sync_grpo.py --threads 1 --seed 0
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from bus.messages import Array, Sample
from policy import build_policy
from policy.tokenizer import CharTokenizer
from runconfig import TrainerConfig
from tasks.digits import DigitsPrompts, digits_reward
from trainer.update import grpo_update

__all__ = ["main", "parse_args", "run"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="max steps (stops early at --target)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--no-stop", action="store_true", help="keep going after the target")
    p.add_argument("--min-digits", type=int, default=4)
    p.add_argument("--max-digits", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="responses per prompt (rollout.n)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--updates", type=int, default=4, help="optimizer steps (mini-batches) "
                   "per generated batch")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=0, help="0: max_digits + 1")
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--entropy-coef", type=float, default=0.01)
    p.add_argument("--quiet", action="store_true", help="print every 10th step only")
    p.add_argument("--show", type=int, default=0, help="print this many samples per report")
    return p.parse_args(argv)


def run(a: argparse.Namespace) -> int | None:
    """Train; return the first step whose mean reward reached the target (None if never)."""
    torch.set_num_threads(a.threads)
    tok = CharTokenizer()
    source = DigitsPrompts(seed=a.seed, min_digits=a.min_digits, max_digits=a.max_digits)
    max_new = a.max_new_tokens or a.max_digits + 1
    policy = build_policy(
        {"kind": "tiny", "d_model": a.d_model, "n_layers": a.layers, "n_heads": a.heads,
         "seed": a.seed},
        device="auto",
    )
    opt = torch.optim.Adam(policy.parameters(), lr=a.lr)
    tc = TrainerConfig(ppo_mini_batch_size=max(1, a.prompts // a.updates), ppo_epochs=1,
                       lr=a.lr, clip_ratio_low=a.clip_low, clip_ratio_high=a.clip_high,
                       grad_clip=a.grad_clip, entropy_coeff=a.entropy_coef)
    reached: int | None = None
    reached_s = 0.0
    t0 = time.perf_counter()
    gen_s = train_s = 0.0  # where the time goes: generation vs update (rollouter vs trainer)
    for step in range(1, a.steps + 1):
        t_gen = time.perf_counter()
        prompts = [source.next() for _ in range(a.prompts)]
        prompt_ids = [tok.encode(p.prompt, bos=True) for p in prompts for _ in range(a.n)]
        gen = policy.generate(prompt_ids, max_new, a.temperature, seed=a.seed * 1_000_003 + step)
        rewards = torch.tensor(
            [digits_reward(tok.decode(r), prompts[i // a.n].answer)
             for i, r in enumerate(gen.tokens)]
        ).view(a.prompts, a.n)
        groups = [
            [Sample(sample_id=f"t{step}-{g}/{i}", ticket_id=f"t{step}-{g}", prompt_id="",
                    index=i, n=a.n,
                    prompt_tokens=Array.of(np.asarray(prompt_ids[g * a.n + i], dtype=np.int32)),
                    response_tokens=Array.of(np.asarray(gen.tokens[g * a.n + i], dtype=np.int32)),
                    logprobs=Array.of(np.asarray(gen.logprobs[g * a.n + i], dtype=np.float32)),
                    reward=float(rewards[g, i]), min_version=step, max_version=step)
             for i in range(a.n)]
            for g in range(a.prompts)
        ]
        t_train = time.perf_counter()
        gen_s += t_train - t_gen
        # The trainer's own update function: the baseline runs the same algorithm.
        policy.train()
        metrics = grpo_update(policy, opt, groups, tc, temperature=a.temperature, version=step,
                              device=policy.device)
        ent_m, clip_m = metrics["actor/entropy"], metrics["actor/pg_clipfrac"]
        kl_m, gnorm_m = metrics["actor/approx_kl"], metrics["actor/grad_norm"]
        train_s += time.perf_counter() - t_train

        r = rewards.mean().item()
        exact = (rewards == 1.0).float().mean().item()
        if reached is None and r >= a.target:
            reached, reached_s = step, time.perf_counter() - t0
        if not a.quiet or step % 10 == 0 or step == 1 or reached == step:
            print(f"step {step:4d}  reward {r:.3f}  exact {exact:.2f}  entropy {ent_m:.3f}"
                  f"  clipfrac {clip_m:.3f}  kl {kl_m:.1e}  gnorm {gnorm_m:.2f}"
                  f"  t {time.perf_counter() - t0:6.1f}s", flush=True)
            for i in range(0, min(a.show * a.n, len(gen.tokens)), a.n):
                print(f"    {prompts[i // a.n].prompt}{tok.decode(gen.tokens[i])!r:8}"
                      f" eos={gen.finished[i]} r={rewards.view(-1)[i].item():.2f}")
        if reached is not None and not a.no_stop:
            break
    elapsed = time.perf_counter() - t0
    if reached is None:
        print(f"did not reach {a.target} in {a.steps} steps ({elapsed:.1f} s)")
    else:
        print(f"reached {a.target} at step {reached} after {reached_s:.1f} s "
              f"({elapsed:.1f} s in all: generate {gen_s:.1f} s, update {train_s:.1f} s)")
    return reached


def main(argv: list[str] | None = None) -> int:
    return 0 if run(parse_args(argv)) is not None else 1


if __name__ == "__main__":
    sys.exit(main())
