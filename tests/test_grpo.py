"""GRPO loss math: advantages, PPO clip, TIS weights, batch layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.grpo import (
    approx_kl,
    build_batch,
    group_advantages,
    masked_mean,
    policy_loss,
    tis_weights,
)


def test_group_advantages_zero_mean_unit_std_per_group() -> None:
    r = torch.tensor([[0.0, 1.0, 0.5, 0.5], [0.2, 0.4, 0.6, 0.8]])
    adv = group_advantages(r)
    assert adv.shape == (2, 4)
    torch.testing.assert_close(adv.mean(1), torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv.std(1, unbiased=False), torch.ones(2), atol=1e-4, rtol=0)
    assert adv[0, 1] > adv[0, 2] > adv[0, 0]  # order within a group is kept


def test_group_advantages_constant_group_is_zero() -> None:
    adv = group_advantages([[0.3, 0.3, 0.3], [0.0, 1.0, 0.0]])
    assert torch.equal(adv[0], torch.zeros(3))
    assert adv[1, 1] > 0 > adv[1, 0]
    assert torch.equal(group_advantages([[1.0], [0.0]]), torch.zeros(2, 1))  # n = 1


def test_group_advantages_rejects_flat_input() -> None:
    with pytest.raises(ValueError, match="groups, n"):
        group_advantages(torch.zeros(8))


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 8).flatmap(
    lambda n: st.lists(st.lists(st.floats(0, 1), min_size=n, max_size=n).map(sorted),
                       min_size=1, max_size=4)
))
def test_group_advantages_properties(groups: list[list[float]]) -> None:
    adv = group_advantages(np.array(groups))
    assert torch.isfinite(adv).all()
    assert adv.mean(1).abs().max() < 1e-4
    # Sorted rewards give non-decreasing advantages.
    assert (adv[:, 1:] - adv[:, :-1] >= -1e-5).all()


def test_ppo_clip_loss_hand_computed() -> None:
    # ratios 1.5, 0.5, 1.0 and a 4th token that the mask removes.
    logp_old = torch.zeros(1, 4)
    logp_new = torch.log(torch.tensor([[1.5, 0.5, 1.0, 9.0]]))
    adv = torch.tensor([[1.0, -1.0, 2.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, clipfrac = policy_loss(logp_new, logp_old, adv, mask, 0.2, 0.2)[:2]
    # token 1: max(-1.5, -1.2) = -1.2 (clipped); token 2: max(0.5, 0.8) = 0.8 (clipped);
    # token 3: -2.0 (ratio 1, not clipped).
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0) / 3, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 3, abs=1e-6)


def test_ppo_clip_higher_and_sequence_advantages() -> None:
    logp_new = torch.log(torch.tensor([[1.25, 1.25], [0.7, 0.7]]))
    logp_old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -1.0])  # one advantage per sequence, broadcast over tokens
    mask = torch.ones(2, 2)
    loss, clipfrac = policy_loss(logp_new, logp_old, adv, mask, clip_low=0.2, clip_high=0.28)[:2]
    # 1.25 < 1.28: not clipped, -1.25; 0.7 < 0.8: clipped to 0.8, loss 0.8.
    assert loss.item() == pytest.approx((-1.25 * 2 + 0.8 * 2) / 4, abs=1e-6)
    assert clipfrac.item() == pytest.approx(0.5)


def test_ppo_clip_loss_mask_respected() -> None:
    g = torch.Generator().manual_seed(0)
    logp_new = torch.randn(3, 5, generator=g)
    logp_old = torch.randn(3, 5, generator=g)
    adv = torch.randn(3, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    loss, _ = policy_loss(logp_new, logp_old, adv, mask)[:2]
    garbage = torch.where(mask.bool(), logp_new, torch.full_like(logp_new, 50.0))
    loss2, _ = policy_loss(garbage, logp_old, adv, mask)[:2]
    assert loss.item() == pytest.approx(loss2.item())
    # Token-level mean: the row with 5 tokens weighs 5x the row with 1.
    ratio = torch.exp(logp_new - logp_old)
    a = adv[:, None].expand(3, 5)
    per = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    assert loss.item() == pytest.approx((per * mask).sum().item() / 9, rel=1e-5)


def test_ppo_gradient_sign() -> None:
    logp_new = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    loss, _ = policy_loss(logp_new, torch.zeros(2, 3), adv, torch.ones(2, 3))[:2]
    loss.backward()
    assert logp_new.grad is not None
    # Descent raises log-probs of positive-advantage tokens and lowers the others.
    assert (logp_new.grad[0] < 0).all() and (logp_new.grad[1] > 0).all()
    # Outside the clip range the gradient vanishes.
    far = torch.full((1, 2), math.log(2.0), requires_grad=True)
    loss, clipfrac = policy_loss(far, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))[:2]
    loss.backward()
    assert far.grad is not None and torch.equal(far.grad, torch.zeros(1, 2))
    assert clipfrac.item() == 1.0


def test_dual_clip_caps_a_negative_advantage_as_verl_does() -> None:
    """verl's vanilla loss (clip_ratio_c=3): a token with A < 0 whose ratio grew past 3
    loses -A x 3, with no gradient; below the bound the loss is the plain clipped one, value
    and gradient alike; figures as verl names them."""
    logp_old = torch.zeros(1, 3)
    logp_new = torch.log(torch.tensor([[5.0, 2.0, 0.5]])).requires_grad_()
    adv = torch.tensor([-2.0])
    pg = policy_loss(logp_new, logp_old, adv, torch.ones(1, 3), 0.2, 0.28)
    # Tokens: 2 x 3 (capped, instead of 2 x 5), 2 x 2 (unclipped side: max(-A r, -A clip)),
    # 2 x 0.8 (the clip's lower edge holds it).
    assert pg.loss.item() == pytest.approx((6.0 + 4.0 + 1.6) / 3)
    assert pg.clipfrac_lower.item() == pytest.approx(1 / 3)
    assert pg.ppo_kl.item() == pytest.approx(-(math.log(5.0) + math.log(2.0) + math.log(0.5)) / 3)
    pg.loss.backward()
    assert logp_new.grad is not None and logp_new.grad[0, 0].item() == 0.0
    plain = logp_new.detach().clone().requires_grad_()
    off = policy_loss(plain, logp_old, adv, torch.ones(1, 3), 0.2, 0.28, clip_ratio_c=None)
    assert off.loss.item() == pytest.approx((10.0 + 4.0 + 1.6) / 3)
    assert off.clipfrac_lower.item() == 0.0
    off.loss.backward()
    assert plain.grad is not None
    assert torch.equal(plain.grad[0, 1:], logp_new.grad[0, 1:])  # below the bound: the same


def test_tis_weights_capped_and_detached() -> None:
    prox = torch.log(torch.tensor([[1.0, 4.0, 0.5]])).requires_grad_()
    behaviour = torch.zeros(1, 3)
    w = tis_weights(prox, behaviour, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.5]]))
    assert not w.requires_grad


def test_ppo_with_tis() -> None:
    logp_new = torch.zeros(1, 3)
    logp_old = torch.zeros(1, 3)
    behaviour = torch.log(torch.tensor([[1.0, 0.25, 2.0]]))  # weights 1, 4 -> cap 2, 0.5
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 3)
    base, _ = policy_loss(logp_new, logp_old, adv, mask)[:2]
    off, _ = policy_loss(logp_new, logp_old, adv, mask, logp_behaviour=behaviour)[:2]
    assert off.item() == base.item()  # tis_cap None: off
    on, _ = policy_loss(logp_new, logp_old, adv, mask, logp_behaviour=behaviour, tis_cap=2.0)[:2]
    assert on.item() == pytest.approx(-(1.0 + 2.0 + 0.5) / 3)


def test_masked_mean_and_kl() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert masked_mean(x, torch.tensor([[1.0, 1.0, 0.0]])).item() == 1.5
    assert masked_mean(x, torch.zeros(1, 3)).item() == 0.0
    assert approx_kl(x, x, torch.ones(1, 3)).item() == 0.0
    assert approx_kl(x, x + 0.1, torch.ones(1, 3)).item() > 0


def test_build_batch_layout() -> None:
    samples = [
        ([1, 5, 6], [7, 2], np.array([-0.1, -0.2], np.float32)),
        ([1, 9], [8, 8, 8, 2], [-1.0, -2.0, -3.0, -4.0]),
        (torch.tensor([1, 4, 4, 4]), torch.tensor([3]), torch.tensor([-0.5])),
    ]
    b = build_batch(samples, pad_id=0)
    assert (b.prompt_width, b.response_len) == (4, 4)
    assert b.input_ids.tolist() == [
        [0, 1, 5, 6, 7, 2, 0, 0],
        [0, 0, 1, 9, 8, 8, 8, 2],
        [1, 4, 4, 4, 3, 0, 0, 0],
    ]
    assert b.attention_mask.tolist() == [
        [0, 1, 1, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 0, 0, 0],
    ]
    assert b.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    torch.testing.assert_close(b.old_logprobs[0], torch.tensor([-0.1, -0.2, 0.0, 0.0]))
    assert b.old_logprobs.dtype == torch.float32 and b.input_ids.dtype == torch.long


def _reference_batch(samples: list[tuple[list[int], list[int], list[float]]], pad_id: int
                     ) -> tuple[list[list[int]], list[list[int]], list[list[float]],
                                list[list[float]]]:
    """The layout written row by row: left-padded prompts, right-padded responses."""
    P = max((len(p) for p, _, _ in samples), default=0)
    R = max((len(r) for _, r, _ in samples), default=0)
    ids, attn, rmask, old = [], [], [], []
    for p, r, lp in samples:
        ids.append([pad_id] * (P - len(p)) + p + r + [pad_id] * (R - len(r)))
        attn.append([0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r)))
        rmask.append([1.0] * len(r) + [0.0] * (R - len(r)))
        old.append([float(np.float32(x)) for x in lp] + [0.0] * (R - len(r)))
    return ids, attn, rmask, old


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 7), st.integers(0, 6), st.integers(0, 10**6)),
                min_size=1, max_size=9),
       st.integers(0, 3))
def test_build_batch_matches_the_row_by_row_layout(
    shapes: list[tuple[int, int, int]], pad_id: int
) -> None:
    samples = []
    for p_len, r_len, seed in shapes:
        rng = np.random.default_rng(seed)
        samples.append((rng.integers(4, 20, p_len).tolist(), rng.integers(4, 20, r_len).tolist(),
                        (-rng.random(r_len)).tolist()))
    from trainer import grpo

    ids, attn, rmask, old = _reference_batch(samples, pad_id)
    kept = grpo.ROW_COPY_TOKENS
    try:
        for threshold in (1 << 62, 0):  # the per-token scatter, then the per-row copy
            grpo.ROW_COPY_TOKENS = threshold
            b = build_batch(samples, pad_id=pad_id)
            assert b.input_ids.tolist() == ids and b.attention_mask.tolist() == attn
            assert b.response_mask.tolist() == rmask and b.old_logprobs.tolist() == old
            assert (b.prompt_width, b.response_len) == (max(s[0] for s in shapes),
                                                        max(s[1] for s in shapes))
    finally:
        grpo.ROW_COPY_TOKENS = kept


def test_build_batch_length_mismatch() -> None:
    with pytest.raises(ValueError, match="sample 0"):
        build_batch([([1], [2, 3], [-1.0])])


class _TablePolicy(torch.nn.Module):
    """A policy whose per-position logits are free parameters (independent of the prompt):
    enough for guarded_step, which needs only logprobs_and_entropy."""

    pad_id = 0

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(logits.clone())

    def logprobs_and_entropy(self, input_ids, attention_mask, response_len, temperature=1.0):
        from policy import logprobs_from_logits

        targets = input_ids[:, -response_len:]
        logits = self.logits[:response_len].expand(len(targets), -1, -1)
        return logprobs_from_logits(logits, targets, temperature)


def _sharp_case(max_kl: float | None) -> tuple[float, float, bool]:
    """The late-training blow-up: a near-deterministic policy (p(correct) ~ 0.999), a group
    where one sample took a rare token and was the only right one (advantage +2.6), the
    other groups all-equal (advantage 0). One clipped-gradient Adam step, then one step on a
    mini-batch with zero gradient (Adam's momentum only). Returns both steps' KL and whether
    the guard had to shrink the second one."""
    from trainer.update import guarded_step

    torch.manual_seed(0)
    V, R = 6, 3
    base = torch.full((R, V), -4.0)
    base[:, 1] = 4.0  # token 1 everywhere: entropy ~0.03
    pol = _TablePolicy(base)
    opt = torch.optim.Adam(pol.parameters(), lr=10.0)  # logits are the parameters: a big lr
    # A long quiet stretch: tiny gradients leave Adam's second moment small.
    for _ in range(50):
        opt.zero_grad()
        (pol.logits.sum() * 1e-4).backward()
        opt.step()
    rare = [1, 3, 1]  # the sample that took token 3 at position 1 and won
    samples = [([5, 2], rare, [-0.1, -8.0, -0.1])] + [([5, 2], [1, 1, 1], [-0.01] * 3)] * 7
    batch = build_batch(samples, pad_id=0)
    adv = group_advantages([[1.0] + [0.0] * 7]).reshape(-1)
    logp, _ = pol.logprobs_and_entropy(batch.input_ids, batch.attention_mask, R)
    loss, _ = policy_loss(logp, logp.detach(), adv, batch.response_mask, 0.2, 0.28)[:2]
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(pol.parameters(), 1.0)
    kl1, shrunk = guarded_step(pol, opt, batch, logp, max_kl, temperature=1.0)
    assert shrunk == (max_kl is not None)
    with torch.no_grad():
        after1, _ = pol.logprobs_and_entropy(batch.input_ids, batch.attention_mask, R)
    assert math.isclose(float(approx_kl(after1, logp, batch.response_mask)), kl1, rel_tol=1e-5) \
        or max_kl is None
    # The next mini-batch teaches nothing (all-equal rewards): its step is momentum only.
    opt.zero_grad()
    (pol.logits.sum() * 0.0).backward()
    _, shrunk2 = guarded_step(pol, opt, batch, after1, max_kl, temperature=1.0)
    with torch.no_grad():
        after2, _ = pol.logprobs_and_entropy(batch.input_ids, batch.attention_mask, R)
    return (float(approx_kl(after1, logp, batch.response_mask)),
            float(approx_kl(after2, after1, batch.response_mask)), shrunk2)


def test_kl_guard_bounds_a_late_blow_up_step_and_its_momentum() -> None:
    kl1, kl2, _ = _sharp_case(None)
    assert kl1 > 0.5  # unguarded: one step moves the sharp policy a lot ...
    assert kl2 > 0.1  # ... and Adam's momentum keeps going on a zero-gradient mini-batch
    g1, g2, shrunk2 = _sharp_case(0.02)
    assert g1 <= 0.02
    assert g2 <= 0.02
    # The first moment was pulled back with the step, so the momentum-only step is small
    # by itself (the guard had nothing left to shrink).
    assert not shrunk2


def test_a_response_mask_leaves_its_zeros_out_of_the_batch_s_response_mask() -> None:
    samples = [([1, 2], [3, 4, 5], [-1.0, -1.0, -1.0]), ([1], [6, 7], [-1.0, -1.0])]
    b = build_batch(samples, masks=[[1, 0, 1], None])
    assert b.response_mask.tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]  # still context
