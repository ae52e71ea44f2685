"""A training step fed mini-batch by mini-batch computes what the batch update computes; the
step's reward is reported under verl's names only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from policy import build_policy
from runconfig import TrainerConfig
from runschema.messages import Array, Sample
from trainer.update import GrpoStep, LateStaleMiniBatch, grpo_update

MODEL = {"kind": "tiny", "d_model": 32, "n_layers": 1, "n_heads": 2, "max_len": 24, "seed": 3}


def _groups(n_groups: int, n: int, version: int, seed: int) -> list[list[Sample]]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        group = []
        for i in range(n):
            length = int(rng.integers(1, 6))
            group.append(Sample(
                sample_id=f"t{g}/{i}", ticket_id=f"t{g}", prompt_id="", index=i, n=n,
                prompt_tokens=Array.of(rng.integers(3, 12, size=5).astype(np.int32)),
                response_tokens=Array.of(rng.integers(3, 12, size=length).astype(np.int32)),
                logprobs=Array.of(-rng.random(length).astype(np.float32) * 3),
                reward=float(rng.integers(0, 2)), min_version=version, max_version=version,
            ))
        groups.append(group)
    return groups


def _setup(tc: TrainerConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    policy = build_policy(MODEL, device="cpu")
    return policy, torch.optim.Adam(policy.parameters(), lr=tc.lr)


@pytest.mark.parametrize("epochs", [1, 2])
def test_streamed_step_equals_the_batch_update(epochs: int) -> None:
    """Stale mini-batches first (as the trainer orders them), then fresh ones trained as
    they come: the weights end bit-identical to grpo_update on the whole batch, which is
    what a resume replays (TrainerResumed.weights_match)."""
    torch.manual_seed(0)
    tc = TrainerConfig(ppo_mini_batch_size=2, ppo_epochs=epochs, tis_cap=2.0)
    version = 5
    groups = _groups(2, 4, version - 1, seed=1) + _groups(4, 4, version, seed=2)

    batch_policy, batch_opt = _setup(tc)
    expected = grpo_update(batch_policy, batch_opt, groups, tc, temperature=1.0,
                           version=version, device="cpu")

    policy, opt = _setup(tc)
    step = GrpoStep(policy, opt, tc, temperature=1.0, version=version, device="cpu")
    for start in range(0, len(groups), 2):
        step.add(groups[start : start + 2])
        step.train()
    got = step.finish()

    for a, b in zip(batch_policy.state_dict().values(), policy.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_the_steps_reward_is_reported_under_verls_names_only() -> None:
    """The step's reward is verl's ``critic/score/mean|max``; the update no longer repeats
    it, or verl's ``response_length/mean``, as ``reward/mean``, ``reward/max`` and
    ``response/length_mean``."""
    tc = TrainerConfig(ppo_mini_batch_size=2)
    groups = _groups(2, 4, 0, seed=1)
    rewards = [s.reward for g in groups for s in g]
    policy, opt = _setup(tc)
    m = grpo_update(policy, opt, groups, tc, temperature=1.0, version=0, device="cpu")
    assert m["critic/score/mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert m["critic/score/max"] == max(rewards)
    assert not {"reward/mean", "reward/max", "response/length_mean"} & m.keys()


def test_a_stale_mini_batch_after_an_optimizer_step_is_refused() -> None:
    """Its proximal log-probs would come from weights the step already moved."""
    tc = TrainerConfig(ppo_mini_batch_size=2, tis_cap=2.0)
    policy, opt = _setup(tc)
    step = GrpoStep(policy, opt, tc, temperature=1.0, version=3, device="cpu")
    step.add(_groups(2, 4, 3, seed=1))
    step.train()
    with pytest.raises(LateStaleMiniBatch, match="optimizer step"):
        step.add(_groups(2, 4, 2, seed=2))
    step.add(_groups(2, 4, 3, seed=3))  # fresh ones still may come
    assert step.finish()["staleness/max"] == 0.0
