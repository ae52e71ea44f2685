"""One GRPO training step as a function of (policy, optimizer, groups, config): no I/O.

The trainer process calls it on its worker thread; the in-process baseline in bench/ calls
the same function, so both run the same algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bus.messages import Sample
from runconfig import TrainerConfig
from trainer.grpo import (
    Batch,
    approx_kl,
    build_batch,
    group_advantages,
    masked_mean,
    ppo_clip_loss,
)

__all__ = ["grpo_update", "guarded_step"]

_GUARD_TRIES = 6  # shrinks per optimizer step before the guard gives up (each >= halves it)


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


@torch.no_grad()
def _shrink(params: list[torch.Tensor], before: list[torch.Tensor],
            optimizer: torch.optim.Optimizer, scale: float) -> None:
    for p, p0 in zip(params, before, strict=True):
        p.sub_(p0).mul_(scale).add_(p0)
        m = optimizer.state.get(p, {}).get("exp_avg")
        if m is not None:  # Adam's momentum would carry the excess into the next steps
            m.mul_(scale)


def guarded_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    logp: torch.Tensor,
    max_kl: float | None,
    *,
    temperature: float,
) -> tuple[float, bool]:
    """``optimizer.step()`` with a KL guard (``trainer.kl_guard``): if the step moved the
    policy by more than ``max_kl`` (approx KL, token mean over ``batch``, against ``logp``,
    the log-probs this step's gradient was taken at), pull it back: parameters towards
    where they were and Adam's first moment by the same factor, until it fits.

    A near-deterministic policy is sharp: one clipped-gradient Adam step can move it by a
    KL of 0.1-1 (the PPO clip acts only on later mini-batches, too late), and Adam's
    momentum keeps moving the same way on the next mini-batches even when their gradient
    is ~0. Returns (the step's KL, whether it was shrunk); max_kl None: a plain step."""
    if max_kl is None:
        optimizer.step()
        return 0.0, False
    params = [p for p in policy.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    optimizer.step()
    shrunk = False
    logp = logp.detach()
    for _ in range(_GUARD_TRIES):
        with torch.no_grad():
            new, _ = policy.logprobs_and_entropy(  # type: ignore[operator]
                batch.input_ids, batch.attention_mask, batch.response_len,
                temperature=temperature,
            )
        kl = float(approx_kl(new, logp, batch.response_mask))
        if kl <= max_kl:
            break
        # KL grows about quadratically with the step: aim just inside the bound.
        _shrink(params, before, optimizer, min(0.5, (max_kl / kl) ** 0.5))
        shrunk = True
    return kl, shrunk


def grpo_update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: Sequence[Sequence[Sample]],
    tc: TrainerConfig,
    *,
    temperature: float,
    version: int,
    device: torch.device | str,
) -> dict[str, float]:
    """Train on ``groups`` (each the ``n`` responses of one prompt, in index order):
    group-normalised advantages, PPO-clip against the rollout log-probs, decoupled PPO with
    truncated importance weights (``tc.tis_cap``) for mini-batches holding samples older
    than ``version``, entropy bonus, grad clipping, one optimizer step per mini-batch and
    epoch, each bounded by the KL guard (``tc.kl_guard``, see :func:`guarded_step`).
    Returns the step's metrics."""
    mb = tc.ppo_mini_batch_size
    rewards = torch.tensor([[s.reward for s in group] for group in groups])
    adv = group_advantages(rewards)
    stats: dict[str, list[float]] = {
        k: [] for k in ("loss", "clip", "ent", "gn", "kl", "ukl", "guard")
    }
    pad_id = policy.pad_id  # type: ignore[attr-defined]
    minibatches = []
    for start in range(0, len(groups), mb):
        flat = [s for group in groups[start : start + mb] for s in group]
        batch = build_batch(
            # copies: Array.numpy() views read-only message bytes
            [(s.prompt_tokens.numpy().copy(), s.response_tokens.numpy().copy(),
              s.logprobs.numpy().copy()) for s in flat],
            pad_id=pad_id, device=device,
        )
        old = batch.old_logprobs
        stale = any(s.min_version < version for s in flat)
        if tc.tis_cap is not None and stale:
            # Decoupled PPO for stale samples: the ratio is taken against the current
            # (proximal) weights and the rollout policy enters only through a truncated
            # importance weight, so a very stale sample cannot dominate the step.
            with torch.no_grad():
                old, _ = policy.logprobs_and_entropy(  # type: ignore[operator]
                    batch.input_ids, batch.attention_mask, batch.response_len,
                    temperature=temperature,
                )
        a = adv[start : start + mb].reshape(-1).to(device)
        minibatches.append((batch, old, a, stale))
    for _ in range(tc.ppo_epochs):
        for batch, old, a, stale in minibatches:
            logp, entropy = policy.logprobs_and_entropy(  # type: ignore[operator]
                batch.input_ids, batch.attention_mask, batch.response_len,
                temperature=temperature,
            )
            use_tis = tc.tis_cap is not None and stale
            loss, clipfrac = ppo_clip_loss(
                logp, old, a, batch.response_mask, tc.clip_ratio_low, tc.clip_ratio_high,
                logp_behaviour=batch.old_logprobs if use_tis else None,
                tis_cap=tc.tis_cap if use_tis else None,
            )
            ent = masked_mean(entropy, batch.response_mask)
            if tc.entropy_coeff:
                loss = loss - tc.entropy_coeff * ent
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), tc.grad_clip)
            update_kl, shrunk = guarded_step(policy, optimizer, batch, logp, tc.kl_guard,
                                             temperature=temperature)
            stats["ukl"].append(update_kl)
            stats["guard"].append(float(shrunk))
            stats["loss"].append(loss.item())
            stats["clip"].append(clipfrac.item())
            stats["ent"].append(ent.item())
            stats["gn"].append(float(grad_norm))
            stats["kl"].append(float(approx_kl(logp, old, batch.response_mask)))
    flat_all = [s for group in groups for s in group]
    staleness = [version - s.min_version for s in flat_all]
    lengths = [len(s.response_tokens) for s in flat_all]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/max": float(rewards.max()),
        "staleness/mean": _mean(staleness),
        "staleness/max": float(max(staleness)),
        "staleness/stale_share": _mean([float(x > 0) for x in staleness]),
        "actor/loss": _mean(stats["loss"]),
        "actor/pg_clipfrac": _mean(stats["clip"]),
        "actor/entropy": _mean(stats["ent"]),
        "actor/grad_norm": _mean(stats["gn"]),
        "actor/approx_kl": _mean(stats["kl"]),
        **({"actor/update_kl_max": max(stats["ukl"], default=0.0),
            "actor/kl_guard_frac": _mean(stats["guard"])} if tc.kl_guard is not None else {}),
        "response/length_mean": _mean(lengths),
    }
