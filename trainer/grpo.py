"""GRPO loss math: group-normalised advantages, the PPO clipped objective, truncated
importance weights for stale samples, and padded batches. Pure torch, no I/O.

Shapes: B sequences, R response columns. Per-token tensors are [B, R] and come with a
response mask (1.0 = a real response token).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np
import torch

from runconfig.rejection import RejectionRule

__all__ = [
    "KL_LOSS_TYPES",
    "Batch",
    "PolicyLoss",
    "approx_kl",
    "build_batch",
    "group_advantages",
    "kl_penalty",
    "masked_mean",
    "micro_batches",
    "policy_loss",
    "probs_diff",
    "rejection_mask",
    "tis_weights",
]

IntSeq = Sequence[int] | np.ndarray | torch.Tensor
FloatSeq = Sequence[float] | np.ndarray | torch.Tensor


@dataclass
class Batch:
    """Prompts left-padded to `prompt_width`, responses right-padded to `response_len`."""

    input_ids: torch.Tensor  # [B, P + R] long
    attention_mask: torch.Tensor  # [B, P + R] long, 1 = real token
    response_mask: torch.Tensor  # [B, R] float32, 1.0 = real response token
    old_logprobs: torch.Tensor  # [B, R] float32, rollout log-probs (0 at pads)
    prompt_width: int
    response_len: int

    def to(self, device: torch.device | str) -> Batch:
        moved: dict[str, Any] = {
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
            for f in fields(self)
        }
        return Batch(**moved)

    def select(self, rows: torch.Tensor | list[int]) -> Batch:
        """Rows ``rows`` (indices), their padding trimmed to their own longest prompt and
        response: columns ``prompt_width - p`` to ``prompt_width + r``. Positions come from the
        mask, so a row's tokens see the same positions; per-token tensors [B, R] of the whole
        batch line up with the result's after ``[rows, :result.response_len]``."""
        P = self.prompt_width
        p = int(self.attention_mask[rows, :P].sum(1).max()) if len(rows) else 0
        r = int(self.response_mask[rows].sum(1).max()) if len(rows) else 0
        return Batch(self.input_ids[rows, P - p : P + r], self.attention_mask[rows, P - p : P + r],
                     self.response_mask[rows, :r], self.old_logprobs[rows, :r], p, r)

    def token_counts(self) -> torch.Tensor:
        """Real tokens (prompt + response) of each row [B]."""
        return self.attention_mask.sum(1)


def _as_1d(x: IntSeq | FloatSeq, dtype: np.dtype[Any]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype, copy=False).reshape(-1)


ROW_COPY_TOKENS = 64
"""Tokens a row (prompt and response) on average from which :func:`build_batch` copies row
by row instead of scattering (bench/build_batch.py: the crossover on this machine's CPU)."""


def build_batch(
    samples: Sequence[tuple[IntSeq, IntSeq, FloatSeq]],
    pad_id: int = 0,
    device: torch.device | str = "cpu",
    masks: Sequence[IntSeq | None] | None = None,
) -> Batch:
    """Batch from (prompt_ids, response_ids, rollout_logprobs) triples, in order; ``masks``:
    each response's mask of trained tokens (a multi-turn response's: 0 for a tool's output;
    None: every token), multiplied into the batch's ``response_mask``, so that every loss
    and figure over it leaves those tokens out while they stay in the attention.

    Short rows: one scatter per tensor, not a Python loop over rows (on small models the
    loop was a tenth of an update). Long rows (:data:`ROW_COPY_TOKENS` a row on average):
    one slice copy per row, a memcpy each, where the scatter's per-token indices cost more
    than the loop (bench/build_batch.py)."""
    prompts = [_as_1d(p, np.dtype(np.int64)) for p, _, _ in samples]
    responses = [_as_1d(r, np.dtype(np.int64)) for _, r, _ in samples]
    logps = [_as_1d(lp, np.dtype(np.float32)) for _, _, lp in samples]
    p_len = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
    r_len = np.fromiter(map(len, responses), dtype=np.int64, count=len(responses))
    lp_len = np.fromiter(map(len, logps), dtype=np.int64, count=len(logps))
    if (bad := np.flatnonzero(r_len != lp_len)).size:
        i = int(bad[0])
        raise ValueError(f"sample {i}: {r_len[i]} response tokens but {lp_len[i]} log-probs")
    B = len(samples)
    P = int(p_len.max(initial=0))
    R = int(r_len.max(initial=0))
    ids = np.full((B, P + R), pad_id, dtype=np.int64)
    attn = np.zeros((B, P + R), dtype=np.int64)
    rmask = np.zeros((B, R), dtype=np.float32)
    old = np.zeros((B, R), dtype=np.float32)
    if B and (int(p_len.sum()) + int(r_len.sum())) >= ROW_COPY_TOKENS * B:
        for i in range(B):  # left-padded prompt ending at column P, the response after it
            p, r = int(p_len[i]), int(r_len[i])
            ids[i, P - p:P] = prompts[i]
            attn[i, P - p:P + r] = 1
            ids[i, P:P + r] = responses[i]
            rmask[i, :r] = 1.0
            old[i, :r] = logps[i]
    elif B:
        # Row i: its prompt ends at column P (left-padded), its response starts there.
        p_rows, p_pos = _ragged(p_len)
        p_cols = P - p_len[p_rows] + p_pos
        ids[p_rows, p_cols] = np.concatenate(prompts)
        attn[p_rows, p_cols] = 1
        r_rows, r_pos = _ragged(r_len)
        ids[r_rows, P + r_pos] = np.concatenate(responses)
        attn[r_rows, P + r_pos] = 1
        rmask[r_rows, r_pos] = 1.0
        old[r_rows, r_pos] = np.concatenate(logps)
    for i, mask in enumerate(masks or ()):
        if mask is not None:
            rmask[i, :r_len[i]] *= _as_1d(mask, np.dtype(np.float32))
    return Batch(torch.from_numpy(ids), torch.from_numpy(attn), torch.from_numpy(rmask),
                 torch.from_numpy(old), P, R).to(device)


def _ragged(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of ``lengths`` laid end to end: each element's row and its index in it."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths
    return rows, np.arange(int(lengths.sum())) - starts[rows]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over positions where mask is 1 (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def group_advantages(
    rewards: torch.Tensor | np.ndarray | Sequence[Sequence[float]], eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages for rewards [G, n] (G prompts, n responses each): (r - mean) / (std +
    eps) within each group, population std. A group of equal rewards gets all zeros, so it
    teaches nothing instead of amplifying float noise."""
    r = torch.as_tensor(np.asarray(rewards) if not isinstance(rewards, torch.Tensor) else rewards)
    r = r.to(torch.float32)
    if r.dim() != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(r.shape)}")
    centred = r - r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    adv = centred / (std + eps)
    return torch.where(std > eps, adv, torch.zeros_like(adv))


def tis_weights(
    logp_proximal: torch.Tensor, logp_behaviour: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance weights min(pi_prox / mu, cap), detached (TIS).

    mu is the policy that generated the sample (the rollout log-probs), pi_prox the one the
    PPO ratio is taken against. Capping keeps a very stale sample from dominating the step.
    """
    return torch.exp(logp_proximal.detach() - logp_behaviour.detach()).clamp(max=cap)


class PolicyLoss(NamedTuple):
    """A micro-batch's policy-gradient loss and verl's figures of it (detached but ``loss``):
    ``clipfrac`` (``actor/pg_clipfrac``), ``clipfrac_lower`` (``actor/pg_clipfrac_lower``:
    the tokens whose loss the dual-clip bound capped) and ``ppo_kl`` (``actor/ppo_kl``: the
    token mean of log pi_old - log pi)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    clipfrac_lower: torch.Tensor
    ppo_kl: torch.Tensor


def policy_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    logp_behaviour: torch.Tensor | None = None,
    tis_cap: float | None = None,
    clip_ratio_c: float | None = 3.0,
) -> PolicyLoss:
    """Token-level PPO clipped surrogate, mask-aware means over tokens (verl's vanilla loss).

    advantages is [B] (one per sequence) or [B, R]. clip_high > clip_low is "clip-higher"
    (DAPO). ``clip_ratio_c`` is dual-clip PPO's bound (verl's ``clip_ratio_c``, default 3):
    a token with a negative advantage loses at most ``-A * clip_ratio_c`` however far its
    ratio grew (None: no bound). With `tis_cap` set and `logp_behaviour` given, each token's
    loss is then weighted by `tis_weights(logp_old, logp_behaviour, tis_cap)`; tis_cap None
    turns that off. clipfrac is the fraction of tokens whose gradient the clip removed.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logp_new.dtype).expand_as(logp_new)
    log_ratio = logp_new - logp_old.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    capped = torch.zeros_like(per_token, dtype=torch.bool)
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        capped = (advantages < 0) & (per_token > bound)
        # where, not minimum: a token below the bound keeps its value and gradient exactly.
        per_token = torch.where(capped, bound, per_token)
    if tis_cap is not None and logp_behaviour is not None:
        per_token = per_token * tis_weights(logp_old, logp_behaviour, tis_cap)
    dtype = logp_new.dtype
    return PolicyLoss(
        loss=masked_mean(per_token, mask),
        clipfrac=masked_mean((clipped > unclipped).to(dtype), mask).detach(),
        clipfrac_lower=masked_mean(capped.to(dtype), mask).detach(),
        ppo_kl=masked_mean(-log_ratio.detach(), mask))


SAFETY_BOUND = 20.0
"""verl's clamp of log pi_old - log pi_rollout before its estimators."""


def rule_keeps(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
               rules: Sequence[RejectionRule]) -> list[torch.Tensor]:
    """verl's rejection sampling (``compute_rollout_rejection_mask``), rule by rule: for each
    of ``rules`` the [B, R] bool mask of the response tokens of ``mask`` it keeps
    (runconfig.rejection). ``logp_old`` is the trainer's log-probs on the step's starting
    weights, ``logp_rollout`` the rollout's."""
    r = (logp_old.detach() - logp_rollout.detach()).float().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    valid = mask.bool()
    m = valid.to(r.dtype)
    estimates = {"k1": -r, "k2": 0.5 * r * r, "k3": torch.exp(r) - 1.0 - r}
    keeps: list[torch.Tensor] = []
    for rule in rules:
        v = estimates[rule.estimator]
        if rule.level == "token":
            x = v
        elif rule.level == "seq_max":
            x = v.masked_fill(~valid, -math.inf).max(dim=-1, keepdim=True).values
            x = torch.where(torch.isinf(x), torch.zeros_like(x), x)
        else:
            x = (v * m).sum(dim=-1, keepdim=True)
            if rule.level == "seq_mean":
                x = x / m.sum(dim=-1, keepdim=True).clamp(min=1.0)
        ok = x <= rule.upper
        if rule.lower is not None:
            ok = ok & (x >= rule.lower)
        keeps.append(valid & ok.expand_as(valid))
    return keeps


def kept_by_all(mask: torch.Tensor, keeps: Sequence[torch.Tensor]) -> torch.Tensor:
    """``mask`` [B, R] with the tokens some rule's ``keeps`` (:func:`rule_keeps`) rejects
    set to 0: every option must keep a token, as verl's."""
    keep = mask.bool()
    for rule_keep in keeps:
        keep = keep & rule_keep
    return keep.to(mask.dtype)


def rejection_mask(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                   rules: Sequence[RejectionRule]) -> torch.Tensor:
    """``mask`` [B, R] with the tokens some rule rejects set to 0."""
    return kept_by_all(mask, rule_keeps(logp_old, logp_rollout, mask, rules))


def probs_diff(logp_trainer: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor
               ) -> torch.Tensor:
    """|exp(logp_rollout) - exp(logp_trainer)| of every masked token, flattened [N], detached.

    The gap between the probability the rollout gave each sampled token and the one the
    trainer gives it (verl's ``training/rollout_probs_diff_*`` with
    ``calculate_log_probs``). In probabilities, as verl: a rare token's log-probs can differ
    a lot while its probabilities barely do, and such a token would swamp the max."""
    gap = (logp_rollout.detach().float().exp() - logp_trainer.detach().float().exp()).abs()
    return gap[mask.bool()]


def approx_kl(logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(old || new) over masked tokens, for monitoring (detached)."""
    d = (logp_old - logp_new).detach()
    return masked_mean(torch.exp(-d) - 1 + d, mask)


KL_LOSS_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs,
    verl's ``kl_loss_type``s (Schulman, "Approximating KL divergence"): kl / k1 =
    logp - ref; abs = |logp - ref|; mse / k2 = (logp - ref)^2 / 2; low_var_kl / k3 =
    exp(ref - logp) - (ref - logp) - 1, with ref - logp clamped to [-20, 20] and the result
    to [-10, 10] as verl does (an outlier token cannot blow the loss up)."""
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref_logp).square()
    if kind in ("low_var_kl", "k3"):
        d = (ref_logp - logp).clamp(min=-20.0, max=20.0)
        return (torch.exp(d) - d - 1).clamp(min=-10.0, max=10.0)
    raise ValueError(f"unknown kl_loss_type {kind!r} (expected one of {KL_LOSS_TYPES})")


def micro_batches(
    token_counts: Sequence[int], micro_batch_size: int | None = None,
    max_token_len: int | None = None,
) -> list[list[int]]:
    """Rows of one mini-batch split for gradient accumulation, each list in row order.

    ``micro_batch_size``: consecutive runs of that many rows (verl's
    ppo_micro_batch_size_per_gpu). ``max_token_len`` (verl's use_dynamic_bsz with
    ppo_max_token_len_per_gpu; wins over micro_batch_size): as few micro-batches as hold
    at most that many real tokens each, rows balanced between them by token count, as
    verl's rearrange_micro_batches; a row longer than the budget goes alone. Neither: one
    micro-batch of every row."""
    n = len(token_counts)
    if max_token_len is not None:
        return _token_packs([int(c) for c in token_counts], max_token_len)
    if micro_batch_size is None or micro_batch_size >= n:
        return [list(range(n))] if n else []
    return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]


def _token_packs(counts: list[int], budget: int) -> list[list[int]]:
    """Balanced packs of at most ``budget`` tokens: start from ceil(total / budget) packs
    (verl's count), deal the rows longest first to the lightest pack, and take one pack
    more while any pack is over the budget with more than one row in it."""
    n = len(counts)
    if not n:
        return []
    k = min(n, -(-sum(counts) // budget))
    while True:
        packs: list[list[int]] = [[] for _ in range(k)]
        loads = [0] * k
        for i in sorted(range(n), key=lambda i: (-counts[i], i)):
            j = min(range(k), key=lambda j: (loads[j], j))
            packs[j].append(i)
            loads[j] += counts[i]
        if k == n or all(load <= budget or len(p) == 1 for p, load in zip(packs, loads,
                                                                           strict=True)):
            return sorted(sorted(p) for p in packs)
        k += 1
