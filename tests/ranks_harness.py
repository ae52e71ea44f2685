"""Rank 0 of a trainer group without the trainer component, for tests/test_trainer_ranks.py:
``python tests/ranks_harness.py OUT.pt KEY=VALUE ...``.

Builds the run's Learner as the trainer does (trainer.ranks.rank_zero_group, the other ranks
started as ``python -m trainer.rank`` processes), trains a fixed sequence of steps on
synthetic groups through the same RankedStep calls trainer.stepwork makes (mini-batches
added one by one, the first epoch streamed), then saves the gathered weights, checkpoint
state, snapshot and every step's metrics to OUT.pt, and the checkpoint after the step
before the last to OUT.pt.ckpt/step-000002.pt. With ``--resume CKPT`` it loads such a
checkpoint first (the trainer's resume path) and trains the last step only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from runconfig import config_to_dict, load_config
from runschema.messages import Array, Sample
from trainer.learner import Learner, make_optimizer
from trainer.ranks import rank_zero_group, spawn_ranks, wait_ranks
from trainer.resume import write_checkpoint

STEPS = 3


def groups_of(step: int, n_groups: int, n: int, version: int) -> list[list[Sample]]:
    """Synthetic groups of ``step``: the same on every run (seeded by the step); the last
    step's samples are one version old (decoupled PPO with TIS)."""
    rng = np.random.default_rng(100 + step)
    out = []
    for g in range(n_groups):
        group = []
        for i in range(n):
            length = int(rng.integers(1, 5))
            prompt = int(rng.integers(2, 6))
            v = version - 1 if step == STEPS and g % 2 == 0 else version
            group.append(Sample(
                sample_id=f"s{step}t{g}/{i}", ticket_id=f"s{step}t{g}", prompt_id="", index=i,
                n=n, prompt_tokens=Array.of(rng.integers(3, 12, size=prompt).astype(np.int32)),
                response_tokens=Array.of(rng.integers(3, 12, size=length).astype(np.int32)),
                logprobs=Array.of(-rng.random(length).astype(np.float32) * 2),
                reward=float(rng.integers(0, 2)), min_version=max(v, 0), max_version=version))
        group[0] = msgspec_replace(group[0], reward=1.0 - group[1].reward)  # never all equal
        out.append(group)
    return out


def msgspec_replace(s: Sample, **kw: float) -> Sample:
    import msgspec

    return msgspec.structs.replace(s, **kw)


def mixed_precision(policy: torch.nn.Module) -> tuple[str, str] | None:
    """FSDP2's (param_dtype, reduce_dtype) on the root unit; None unsharded. (Private torch
    API, read by a test only: torch is pinned.)"""
    state = getattr(policy, "_get_fsdp_state", None)
    if state is None:
        return None
    mp = state()._mp_policy
    return str(mp.param_dtype), str(mp.reduce_dtype)


def main(argv: list[str]) -> int:
    out, rest = argv[0], argv[1:]
    resume = None
    if rest and rest[0] == "--resume":
        resume, rest = rest[1], rest[2:]
    cfg = load_config(None, ["trainer.threads=1", "model.d_model=32", "model.n_layers=2",
                             "model.n_heads=2", "trainer.ppo_mini_batch_size=2",
                             "rollout.n=4", "trainer.lr=0.01", *rest])
    tc = cfg.trainer
    group = rank_zero_group(tc)
    procs = []
    if group.spec is not None:
        procs = spawn_ranks(range(1, tc.n_gpus_per_node), tc.n_gpus_per_node, group.world,
                            group.spec.addr, group.spec.port, device=tc.device,
                            timeout_s=tc.dist_timeout_s)
        group.open()
        group.send("config", (config_to_dict(cfg), 0))
    learner = Learner(cfg, group)
    learner.build()
    learner.optimizer, learner.scheduler = make_optimizer(learner.policy.parameters(), tc)
    if resume is not None:
        learner.load_checkpoint(resume)
    metrics = []
    mb = tc.ppo_mini_batch_size
    first = 1 if resume is None else STEPS
    for step in range(first, STEPS + 1):
        learner.version = step - 1
        groups = groups_of(step, 2 * mb, cfg.rollout.n, learner.version)
        ranked = learner.step()
        for start in range(0, len(groups), mb):
            ranked.add(groups[start:start + mb])
            # Fresh samples stream; the stale step trains at the end, and every step does
            # with rejection sampling (StepCore._feed: not before the step is whole).
            if step != STEPS and tc.rollout_rs is None:
                ranked.train()
        metrics.append(ranked.finish())
        if step == STEPS - 1:  # as the trainer writes it (trainer.checkpoint_format)
            write_checkpoint(Path(out + ".ckpt"), step, learner.version,
                             learner.checkpoint_payload, b"")
    model, optim = learner.checkpoint_state()
    snapshot = learner.snapshot()
    torch.save({"model": model, "optimizer": optim, "snapshot": snapshot,
                "metrics": metrics, "version": learner.version,
                "mixed_precision": mixed_precision(learner.policy)}, out)
    learner.stop_ranks()
    codes = wait_ranks(procs, 60)
    group.close()
    return max(codes, default=0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
