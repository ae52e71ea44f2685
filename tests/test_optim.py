"""The trainer's optimizer: AdamW with weight decay and verl's lr schedules (warm-up, constant
or cosine with min_lr_ratio and num_cycles), stepped once per training step, carried in the
checkpoint so a resume continues it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from policy import build_policy
from runconfig import TrainerConfig
from runschema.messages import Array, Sample
from trainer.learner import lr_factor, make_optimizer, warmup_steps
from trainer.resume import load_checkpoint, write_checkpoint
from trainer.update import grpo_update

MODEL = {"kind": "tiny", "d_model": 32, "n_layers": 1, "n_heads": 2, "max_len": 24, "seed": 3}


def _verl_cosine(step: int, warm: int, total: int, min_ratio: float, cycles: float) -> float:
    """verl.utils.torch_functional.get_cosine_schedule_with_warmup's lr_lambda, written out."""
    if step < warm:
        return step / max(1, warm)
    progress = (step - warm) / max(1, total - warm)
    return max(min_ratio, 0.5 * (1 + min_ratio) + 0.5 * (1 - min_ratio)
               * math.cos(math.pi * cycles * 2.0 * progress))


def test_warmup_steps_as_verl_counts_them() -> None:
    assert warmup_steps(TrainerConfig()) == 0
    assert warmup_steps(TrainerConfig(lr_warmup_steps=7, lr_warmup_steps_ratio=0.5)) == 7
    # -1 (and 0): the ratio of the total, rounded down.
    tc = TrainerConfig(lr_warmup_steps=-1, lr_warmup_steps_ratio=0.1, total_training_steps=55)
    assert warmup_steps(tc) == 5
    assert warmup_steps(TrainerConfig(lr_warmup_steps=0, lr_warmup_steps_ratio=0.5,
                                      total_training_steps=10)) == 5


def test_constant_schedule_with_warmup() -> None:
    tc = TrainerConfig(lr_warmup_steps=4, total_training_steps=20)
    assert [lr_factor(s, tc) for s in (0, 1, 2, 3, 4, 5, 19, 40)] == [
        0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    # min_lr_ratio is the cosine's: constant ignores it, as verl's constant schedule does.
    tc = TrainerConfig(min_lr_ratio=0.3, total_training_steps=20)
    assert lr_factor(0, tc) == lr_factor(19, tc) == 1.0


@pytest.mark.parametrize(("warm", "min_ratio", "cycles"), [(0, 0.0, 0.5), (2, 0.1, 0.5),
                                                           (3, 0.0, 1.0)])
def test_cosine_schedule_is_verls(warm: int, min_ratio: float, cycles: float) -> None:
    tc = TrainerConfig(lr_scheduler_type="cosine", lr_warmup_steps=warm, min_lr_ratio=min_ratio,
                       num_cycles=cycles, total_training_steps=10)
    for step in range(12):
        assert lr_factor(step, tc) == pytest.approx(
            _verl_cosine(step, warm, 10, min_ratio, cycles), abs=1e-12)
    # Chosen points by hand: half-way through the decay the cosine is at 0, at the end at -1.
    tc = TrainerConfig(lr_scheduler_type="cosine", lr_warmup_steps=2, min_lr_ratio=0.1,
                       total_training_steps=10)
    assert lr_factor(1, tc) == 0.5
    assert lr_factor(6, tc) == pytest.approx(0.55)  # progress 4/8: (1 + 0.1) / 2
    assert lr_factor(10, tc) == pytest.approx(0.1)  # progress 1: min_lr_ratio
    assert lr_factor(11, tc) >= 0.1  # never below min_lr_ratio


def test_adamw_with_weight_decay() -> None:
    tc = TrainerConfig(lr=0.1, weight_decay=0.5)
    w = torch.nn.Parameter(torch.tensor([2.0, -4.0]))
    opt, _ = make_optimizer([w], tc)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    w.grad = torch.zeros(2)  # Adam's own step is 0: only the decoupled decay moves w
    opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor([2.0, -4.0]) * (1 - 0.1 * 0.5))
    v = torch.nn.Parameter(torch.tensor([2.0, -4.0]))
    plain, _ = make_optimizer([v], TrainerConfig(lr=0.1))  # weight_decay 0: untouched
    v.grad = torch.zeros(2)
    plain.step()
    torch.testing.assert_close(v.detach(), torch.tensor([2.0, -4.0]))


def _groups(seed: int, n_groups: int = 2, n: int = 4) -> list[list[Sample]]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        group = []
        for i in range(n):
            length = int(rng.integers(1, 6))
            group.append(Sample(
                sample_id=f"t{g}/{i}", ticket_id=f"t{g}", prompt_id="", index=i, n=n,
                prompt_tokens=Array.of(rng.integers(3, 12, size=5).astype(np.int32)),
                response_tokens=Array.of(rng.integers(3, 12, size=length).astype(np.int32)),
                logprobs=Array.of(-rng.random(length).astype(np.float32) * 3),
                reward=float(i % 2), min_version=0, max_version=0,
            ))
        out.append(group)
    return out


def _train(policy: torch.nn.Module, opt: torch.optim.Optimizer, sched: object,
           tc: TrainerConfig, steps: range) -> list[float]:
    return [grpo_update(policy, opt, _groups(s), tc, temperature=1.0, version=0, device="cpu",
                        scheduler=sched)["actor/lr"] for s in steps]


def test_one_schedule_step_per_training_step_and_actor_lr() -> None:
    tc = TrainerConfig(lr=1e-2, lr_warmup_steps=2, lr_scheduler_type="cosine",
                       total_training_steps=6, ppo_mini_batch_size=1, ppo_epochs=2)
    policy = build_policy(MODEL, "cpu")
    opt, sched = make_optimizer(policy.parameters(), tc)
    # Two mini-batches x two epochs = four optimizer steps per training step; the schedule
    # moves once per training step (verl's unit) and actor/lr is the lr the step used.
    lrs = _train(policy, opt, sched, tc, range(6))
    assert lrs == pytest.approx([1e-2 * lr_factor(s, tc) for s in range(6)])
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-2)


def test_the_schedule_survives_a_checkpoint(tmp_path: Path) -> None:
    tc = TrainerConfig(lr=1e-2, lr_warmup_steps=2, lr_scheduler_type="cosine",
                       min_lr_ratio=0.2, total_training_steps=8, weight_decay=0.01)
    policy = build_policy(MODEL, "cpu")
    opt, sched = make_optimizer(policy.parameters(), tc)
    _train(policy, opt, sched, tc, range(3))
    path, _ = write_checkpoint(tmp_path, 3, 3, _whole(policy, opt), b"state")
    expected = _train(policy, opt, sched, tc, range(3, 6))

    resumed = build_policy(MODEL, "cpu")
    opt2, sched2 = make_optimizer(resumed.parameters(), tc)
    load_checkpoint(str(path), resumed, opt2, "cpu")
    assert sched2.last_epoch == 3
    got = _train(resumed, opt2, sched2, tc, range(3, 6))
    assert got == expected == pytest.approx([1e-2 * lr_factor(s, tc) for s in range(3, 6)])
    for a, b in zip(policy.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    # A fresh schedule, not loaded, would have started again from the warm-up.
    fresh_opt, fresh = make_optimizer(build_policy(MODEL, "cpu").parameters(), tc)
    assert fresh.last_epoch == 0 and fresh_opt.param_groups[0]["lr"] == 0.0


def _whole(policy: Any, opt: Any) -> Any:
    """A one-rank checkpoint's payload (trainer.learner.Learner.checkpoint_payload)."""
    return lambda _path: {"model": policy.state_dict(), "optimizer": opt.state_dict()}
