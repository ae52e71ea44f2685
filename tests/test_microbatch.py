"""Micro-batches with gradient accumulation (verl's ppo_micro_batch_size_per_gpu, and
use_dynamic_bsz with ppo_max_token_len_per_gpu): the same gradient, step and metrics as the
whole mini-batch at once."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from policy import build_policy
from runconfig import TrainerConfig
from runschema.messages import Array, Sample
from trainer.grpo import build_batch, micro_batches
from trainer.learner import frozen_copy
from trainer.update import GrpoStep, grpo_update

MODEL = {"kind": "tiny", "d_model": 32, "n_layers": 1, "n_heads": 2, "max_len": 24, "seed": 3}


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


def test_micro_batches_by_count() -> None:
    assert micro_batches([5] * 5) == [[0, 1, 2, 3, 4]]
    assert micro_batches([5] * 5, 2) == [[0, 1], [2, 3], [4]]
    assert micro_batches([5] * 5, 1) == [[0], [1], [2], [3], [4]]
    assert micro_batches([5] * 3, 8) == [[0, 1, 2]]
    assert micro_batches([]) == []


@pytest.mark.parametrize("budget", [8, 10, 13, 20, 100])
def test_micro_batches_by_tokens(budget: int) -> None:
    counts = [7, 3, 5, 2, 8, 4, 6, 1]
    packs = micro_batches(counts, micro_batch_size=2, max_token_len=budget)  # budget wins
    assert sorted(i for p in packs for i in p) == list(range(len(counts)))
    assert all(p == sorted(p) for p in packs)
    assert all(sum(counts[i] for i in p) <= budget for p in packs)
    # As few packs as the budget allows (verl: ceil(total / budget)), plus one at most
    # here where balancing needs it.
    assert -(-sum(counts) // budget) <= len(packs) <= -(-sum(counts) // budget) + 1
    # A row longer than the budget goes alone.
    assert [0] in micro_batches([30, 2, 2], max_token_len=10)


def test_select_trims_padding() -> None:
    b = build_batch([([1, 2, 3, 4], [5, 6], [-0.1, -0.2]), ([1], [7, 8, 9, 10], [-1.0] * 4),
                     ([1, 2], [11], [-0.5])])
    sub = b.select([0, 2])
    assert (sub.prompt_width, sub.response_len) == (4, 2)
    assert sub.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [0, 0, 1, 2, 11, 0]]
    assert sub.response_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    one = b.select([2])
    assert one.input_ids.tolist() == [[1, 2, 11]] and one.old_logprobs.tolist() == [[-0.5]]


def _groups(seed: int, n_groups: int, n: int = 4, *, stale: bool = False,
            dead: int | None = None) -> list[list[Sample]]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        group = []
        for i in range(n):
            length = int(rng.integers(1, 7))
            prompt = int(rng.integers(2, 8))
            version = int(rng.integers(0, 2)) if stale else 2
            group.append(Sample(
                sample_id=f"t{g}/{i}", ticket_id=f"t{g}", prompt_id="", index=i, n=n,
                prompt_tokens=Array.of(rng.integers(3, 12, size=prompt).astype(np.int32)),
                response_tokens=Array.of(rng.integers(3, 12, size=length).astype(np.int32)),
                logprobs=Array.of(-rng.random(length).astype(np.float32) * 3),
                reward=1.0 if g == dead else float(rng.integers(0, 2)),
                min_version=version, max_version=version,
            ))
        groups.append(group)
    return groups


def _run(tc: TrainerConfig, groups: list[list[Sample]], optimizer: str = "sgd"
         ) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    policy = build_policy(MODEL, "cpu")
    ref = frozen_copy(policy)
    with torch.no_grad():  # a policy off its reference, so the KL loss has a gradient
        for p in policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    opt: torch.optim.Optimizer = (torch.optim.SGD(policy.parameters(), lr=0.5)
                                  if optimizer == "sgd" else
                                  torch.optim.AdamW(policy.parameters(), lr=1e-3))
    metrics = grpo_update(policy, opt, groups, tc, temperature=1.0, version=2, device="cpu",
                          reference=ref if tc.use_kl_loss else None)
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for p in policy.parameters()]
    return [p.detach().clone() for p in policy.parameters()], grads, metrics


SPLITS: list[dict[str, Any]] = [
    {"micro_batch_size": 1},
    {"micro_batch_size": 3},
    {"use_dynamic_bsz": True, "max_token_len": 12},
    {"use_dynamic_bsz": True, "max_token_len": 30},
]
SETUPS: list[dict[str, Any]] = [
    {},
    {"use_kl_loss": True, "kl_loss_coef": 0.5, "kl_loss_type": "k3"},
    {"use_kl_loss": True, "kl_loss_type": "mse", "zero_adv": "drop", "ppo_epochs": 2},
    {"kl_guard": 1e-4, "tis_cap": 2.0},
]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("setup", SETUPS)
def test_micro_batches_give_the_mini_batch_gradient(split: dict[str, Any],
                                                    setup: dict[str, Any]) -> None:
    stale = "tis_cap" in setup
    groups = _groups(7, 4, stale=stale, dead=1)
    base = TrainerConfig(ppo_mini_batch_size=2, entropy_coeff=0.01, **setup)
    params0, grads0, m0 = _run(base, groups)
    params1, grads1, m1 = _run(TrainerConfig(ppo_mini_batch_size=2, entropy_coeff=0.01,
                                             **setup, **split), groups)
    assert any(g.abs().sum() > 0 for g in grads0)
    for a, b in zip(grads0, grads1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(params0, params1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert m0.keys() == m1.keys()
    for key, value in m0.items():
        assert m1[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_micro_batches_with_adamw_and_epochs() -> None:
    groups = _groups(11, 4)
    setup = {"ppo_mini_batch_size": 2, "ppo_epochs": 2, "use_kl_loss": True}
    p0, _, m0 = _run(TrainerConfig(**setup), groups, optimizer="adamw")
    p1, _, m1 = _run(TrainerConfig(**setup, micro_batch_size=2), groups, optimizer="adamw")
    for a, b in zip(p0, p1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert m1["actor/kl_loss"] == pytest.approx(m0["actor/kl_loss"], rel=1e-3, abs=1e-7)


def test_the_default_takes_one_micro_batch() -> None:
    policy = build_policy(MODEL, "cpu")
    step = GrpoStep(policy, torch.optim.SGD(policy.parameters(), lr=0.1), TrainerConfig(),
                    temperature=1.0, version=2, device="cpu")
    step.add(_groups(3, 2))
    assert step.minibatches[0].micro == [slice(None)]
    step = GrpoStep(policy, torch.optim.SGD(policy.parameters(), lr=0.1),
                    TrainerConfig(micro_batch_size=3), temperature=1.0, version=2, device="cpu")
    step.add(_groups(3, 2))
    assert step.minibatches[0].micro == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_tokens_a_response_mask_leaves_out_do_not_train() -> None:
    """A multi-turn response's mask (0: a tool's output) keeps those tokens out of every
    loss: their rollout log-probs can be anything, the step is the same; without the mask
    it is not."""
    import msgspec

    cfg = TrainerConfig(ppo_mini_batch_size=2, entropy_coeff=0.0, weight_decay=0.0)

    def masked(groups: list, logprob: float | None) -> list:
        out = []
        for group in groups:
            row = []
            for s in group:
                n = len(s.response_tokens)
                mask = np.ones(n, dtype=np.int8)
                mask[n // 2:] = 0 if n > 1 else 1  # the second half: a tool's output
                lp = s.logprobs.numpy().copy()
                if logprob is not None and n > 1:
                    lp[n // 2:] = logprob
                row.append(msgspec.structs.replace(s, response_mask=Array.of(mask),
                                                   logprobs=Array.of(lp)))
            out.append(row)
        return out

    groups = _groups(11, 4)
    _, a, _ = _run(cfg, masked(groups, None))
    _, b, _ = _run(cfg, masked(groups, -7.0))
    _, plain, _ = _run(cfg, groups)
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, atol=1e-6)
    assert any(not torch.allclose(x, y, atol=1e-6) for x, y in zip(a, plain, strict=True))
