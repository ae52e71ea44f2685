"""trainer.zero_adv: a mini-batch whose groups all have equal rewards (advantages all 0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from policy import build_policy
from runconfig import TrainerConfig
from runschema.messages import Array, Sample
from trainer.update import GrpoStep, grpo_update

MODEL = {"kind": "tiny", "d_model": 32, "n_layers": 1, "n_heads": 2, "max_len": 24, "seed": 3}


def _groups(n_groups: int, n: int, seed: int, *, equal: bool) -> list[list[Sample]]:
    """Groups of random samples; ``equal``: every reward of a group is the same."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        group = []
        for i in range(n):
            length = int(rng.integers(1, 6))
            reward = 1.0 if equal else float(i % 2)
            group.append(Sample(
                sample_id=f"t{seed}-{g}/{i}", ticket_id=f"t{seed}-{g}", prompt_id="", index=i,
                n=n, prompt_tokens=Array.of(rng.integers(3, 12, size=5).astype(np.int32)),
                response_tokens=Array.of(rng.integers(3, 12, size=length).astype(np.int32)),
                logprobs=Array.of(-rng.random(length).astype(np.float32) * 3),
                reward=reward, min_version=1, max_version=1,
            ))
        groups.append(group)
    return groups


def _setup(tc: TrainerConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    policy = build_policy(MODEL, device="cpu")
    return policy, torch.optim.Adam(policy.parameters(), lr=tc.lr)


def _snapshot(policy: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in policy.parameters()]
    for p in policy.parameters():
        for v in opt.state[p].values():
            out.append(torch.as_tensor(v).detach().clone())
    return out


def _step(policy: torch.nn.Module, opt: torch.optim.Optimizer, groups: list[list[Sample]],
          tc: TrainerConfig) -> dict[str, float]:
    return grpo_update(policy, opt, groups, tc, temperature=1.0, version=1, device="cpu")


@pytest.mark.parametrize("mode", ["skip", "drop"])
def test_all_zero_advantage_mini_batch_leaves_weights_and_adam_state(mode: str) -> None:
    tc = TrainerConfig(ppo_mini_batch_size=2, zero_adv=mode)
    policy, opt = _setup(tc)
    _step(policy, opt, _groups(2, 4, seed=1, equal=False), tc)  # Adam has moments now
    before = _snapshot(policy, opt)
    metrics = _step(policy, opt, _groups(2, 4, seed=2, equal=True), tc)
    after = _snapshot(policy, opt)
    assert len(after) == len(before)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    assert metrics["actor/zero_adv_frac"] == 1.0
    assert metrics["actor/grad_norm"] == 0.0
    assert metrics["actor/entropy"] > 0.0  # still measured


def test_keep_moves_the_weights_on_an_all_zero_advantage_mini_batch() -> None:
    """The behaviour ``skip`` removes: the entropy bonus alone, scaled up by Adam (and
    Adam's momentum), moves the weights."""
    assert TrainerConfig().zero_adv == "skip"  # the default
    tc = TrainerConfig(ppo_mini_batch_size=2, zero_adv="keep")
    policy, opt = _setup(tc)
    _step(policy, opt, _groups(2, 4, seed=1, equal=False), tc)
    before = _snapshot(policy, opt)
    metrics = _step(policy, opt, _groups(2, 4, seed=2, equal=True), tc)
    assert "actor/zero_adv_frac" not in metrics
    assert not all(torch.equal(a, b) for a, b in zip(before, _snapshot(policy, opt),
                                                     strict=True))


def test_no_entropy_steps_with_zero_gradient() -> None:
    tc = TrainerConfig(ppo_mini_batch_size=2, zero_adv="no_entropy")
    policy, opt = _setup(tc)
    _step(policy, opt, _groups(2, 4, seed=1, equal=False), tc)
    metrics = _step(policy, opt, _groups(2, 4, seed=2, equal=True), tc)
    assert metrics["actor/grad_norm"] == 0.0
    assert metrics["actor/zero_adv_frac"] == 1.0


def test_drop_trains_as_if_the_equal_reward_groups_were_absent() -> None:
    """``drop``: in a mixed mini-batch, groups of equal rewards leave the token mean."""
    tc = TrainerConfig(ppo_mini_batch_size=3, zero_adv="drop")
    live = _groups(2, 4, seed=1, equal=False)
    dead = _groups(1, 4, seed=2, equal=True)
    mixed_policy, mixed_opt = _setup(tc)
    _step(mixed_policy, mixed_opt, [live[0], dead[0], live[1]], tc)
    tc_live = TrainerConfig(ppo_mini_batch_size=2, zero_adv="drop")
    live_policy, live_opt = _setup(tc_live)
    _step(live_policy, live_opt, live, tc_live)
    for a, b in zip(mixed_policy.parameters(), live_policy.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # ... which "skip" does not do: the equal-reward group dilutes the mean and adds entropy.
    tc_skip = TrainerConfig(ppo_mini_batch_size=3, zero_adv="skip")
    skip_policy, skip_opt = _setup(tc_skip)
    _step(skip_policy, skip_opt, [live[0], dead[0], live[1]], tc_skip)
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in
                   zip(skip_policy.parameters(), live_policy.parameters(), strict=True))


@pytest.mark.parametrize("mode", ["skip", "no_entropy", "drop"])
@pytest.mark.parametrize("epochs", [1, 2])
def test_streamed_step_equals_the_batch_update(mode: str, epochs: int) -> None:
    """Replay stays exact: mini-batch by mini-batch == grpo_update, bit for bit."""
    tc = TrainerConfig(ppo_mini_batch_size=2, ppo_epochs=epochs, zero_adv=mode)
    groups = (_groups(2, 4, seed=1, equal=False) + _groups(2, 4, seed=2, equal=True)
              + _groups(1, 4, seed=3, equal=True) + _groups(1, 4, seed=4, equal=False))
    batch_policy, batch_opt = _setup(tc)
    expected = _step(batch_policy, batch_opt, groups, tc)
    policy, opt = _setup(tc)
    step = GrpoStep(policy, opt, tc, temperature=1.0, version=1, device="cpu")
    for start in range(0, len(groups), 2):
        step.add(groups[start : start + 2])
        step.train()
    got = step.finish()
    for a, b in zip(_snapshot(batch_policy, batch_opt), _snapshot(policy, opt), strict=True):
        assert torch.equal(a, b)
    assert got == expected
    assert got["actor/zero_adv_frac"] == pytest.approx(1 / 3)
