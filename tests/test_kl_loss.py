"""The KL loss (verl's use_kl_loss): verl's estimators on known numbers, against a frozen copy
of the initial weights, in the loss with kl_loss_coef."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from policy import build_policy
from runconfig import TrainerConfig, load_config
from runschema.messages import Array, Sample
from trainer.grpo import kl_penalty
from trainer.learner import Learner, frozen_copy
from trainer.update import grpo_update

MODEL = {"kind": "tiny", "d_model": 32, "n_layers": 1, "n_heads": 2, "max_len": 24, "seed": 3}
LOGP = torch.tensor([-1.0, -2.0, -0.5])
REF = torch.tensor([-1.5, -1.0, -0.5])


@pytest.mark.parametrize(("kind", "expected"), [
    ("kl", [0.5, -1.0, 0.0]),
    ("k1", [0.5, -1.0, 0.0]),
    ("abs", [0.5, 1.0, 0.0]),
    ("mse", [0.125, 0.5, 0.0]),
    ("k2", [0.125, 0.5, 0.0]),
    # exp(d) - d - 1 with d = ref - logp = (-0.5, 1, 0)
    ("low_var_kl", [math.exp(-0.5) + 0.5 - 1, math.e - 2, 0.0]),
    ("k3", [math.exp(-0.5) + 0.5 - 1, math.e - 2, 0.0]),
])
def test_estimators_on_known_numbers(kind: str, expected: list[float]) -> None:
    torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor(expected))


def test_low_var_kl_clamps_as_verl() -> None:
    # ref - logp is clamped to [-20, 20] (no overflow, no gradient past it), the estimate to
    # [-10, 10].
    logp = torch.tensor([-40.0, 0.0, -2.0, 0.0], requires_grad=True)
    out = kl_penalty(logp, torch.tensor([0.0, -40.0, 0.0, -2.0]), "k3")
    assert out[0].item() == 10.0 and out[1].item() == 10.0
    assert out[2].item() == pytest.approx(math.exp(2) - 3)
    assert out[3].item() == pytest.approx(math.exp(-2) + 1)
    out.sum().backward()
    assert logp.grad is not None
    assert logp.grad[0].item() == 0.0 and logp.grad[1].item() == 0.0  # clamped
    assert logp.grad[2].item() == pytest.approx(1 - math.exp(2))
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_penalty(LOGP, REF, "full")


def _groups(seed: int, rewards: list[float] | None = None) -> list[list[Sample]]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(2):
        group = []
        for i in range(4):
            length = int(rng.integers(1, 6))
            group.append(Sample(
                sample_id=f"t{g}/{i}", ticket_id=f"t{g}", prompt_id="", index=i, n=4,
                prompt_tokens=Array.of(rng.integers(3, 12, size=5).astype(np.int32)),
                response_tokens=Array.of(rng.integers(3, 12, size=length).astype(np.int32)),
                logprobs=Array.of(-rng.random(length).astype(np.float32) * 3),
                reward=float(i % 2) if rewards is None else rewards[i],
                min_version=0, max_version=0,
            ))
        out.append(group)
    return out


@pytest.mark.parametrize("kind", ["low_var_kl", "kl", "abs", "mse"])
def test_kl_loss_is_zero_while_the_policy_is_the_reference(kind: str) -> None:
    tc = TrainerConfig(use_kl_loss=True, kl_loss_type=kind, kl_loss_coef=0.05,
                       ppo_mini_batch_size=2)  # one mini-batch: no step before it
    policy = build_policy(MODEL, "cpu")
    ref = frozen_copy(policy)
    m = grpo_update(policy, torch.optim.AdamW(policy.parameters(), lr=1e-2), _groups(1), tc,
                    temperature=1.0, version=0, device="cpu", reference=ref)
    assert m["actor/kl_loss"] == 0.0 and m["actor/kl_coef"] == 0.05
    # The step moved the policy away from the reference; the next step measures it.
    m = grpo_update(policy, torch.optim.AdamW(policy.parameters(), lr=1e-2), _groups(2), tc,
                    temperature=1.0, version=0, device="cpu", reference=ref)
    assert m["actor/kl_loss"] != 0.0
    # The reference never trains.
    assert all(not p.requires_grad and p.grad is None for p in ref.parameters())
    fresh = build_policy(MODEL, "cpu")
    for a, b in zip(ref.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def _grad_norm(use_kl_loss: bool) -> float:
    """One step whose only loss term can be the KL: equal rewards (advantages 0, kept), no
    entropy bonus, a policy moved off its reference."""
    tc = TrainerConfig(use_kl_loss=use_kl_loss, kl_loss_coef=1.0, entropy_coeff=0.0,
                       zero_adv="keep", ppo_mini_batch_size=2)
    policy = build_policy(MODEL, "cpu")
    ref = frozen_copy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    m = grpo_update(policy, torch.optim.SGD(policy.parameters(), lr=0.0), _groups(3, [1.0] * 4),
                    tc, temperature=1.0, version=0, device="cpu", reference=ref)
    return m["actor/grad_norm"]


def test_the_kl_loss_gradient_flows_into_the_policy() -> None:
    assert _grad_norm(use_kl_loss=False) == 0.0
    assert _grad_norm(use_kl_loss=True) > 0.0


def test_learner_builds_the_reference_from_the_model_config() -> None:
    cfg = load_config(None, ["trainer.use_kl_loss=true", "trainer.device=cpu"])
    learner = Learner(cfg)
    learner.build()
    assert learner.reference is not None and learner.reference is not learner.policy
    with torch.no_grad():  # training moves the policy, never the reference
        for p in learner.policy.parameters():
            p.add_(1.0)
    again = Learner(cfg)  # a resumed trainer rebuilds the same reference
    again.build()
    for a, b in zip(learner.reference.parameters(), again.reference.parameters(), strict=True):
        assert torch.equal(a, b)
    off = Learner(load_config(None, ["trainer.device=cpu"]))
    off.build()
    assert off.reference is None
