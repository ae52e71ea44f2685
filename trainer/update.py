"""One GRPO training step as a function of (policy, optimizer, groups, config): no I/O.

The trainer hands mini-batches to a :class:`GrpoStep` as their groups arrive and lets it
train the first epoch of each while later groups are still being generated;
:func:`grpo_update` is the batch use (every mini-batch added, then finished): what a
resume replays and what the in-process baseline in bench/ calls, so all run the same
algorithm. Both orders compute the same thing, provided every *stale* mini-batch (samples
older than the trainer's weights) is added before the step's first optimizer step: its
proximal log-probs are taken with the weights the step started from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from runconfig import TrainerConfig
from runconfig.rejection import rejection_rules
from runschema.messages import Sample
from tasks.rewards import extra_metrics
from trainer.grpo import (
    SAFETY_BOUND,
    Batch,
    PolicyLoss,
    approx_kl,
    build_batch,
    group_advantages,
    kept_by_all,
    kl_penalty,
    masked_mean,
    micro_batches,
    policy_loss,
    probs_diff,
    rule_keeps,
)
from trainer.metrics import critic_metrics
from trainer.ranks import RankGroup
from trainer.rowsplit import balanced_rows, rank_loads, seqlen_metrics, strided_rows
from trainer.sharding import reduce_gradients

__all__ = ["GrpoStep", "LateStaleMiniBatch", "grpo_update", "guarded_step"]

Rows = slice | list[int]
""":class:`_Micro` rows: ``slice(None)`` (the whole mini-batch, its tensors as they are) or
row indices."""


_GUARD_TRIES = 6  # shrinks per optimizer step before the guard gives up (each >= halves it)


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def _probs_diff_metrics(diffs: Sequence[torch.Tensor]) -> dict[str, float]:
    """verl's ``training/rollout_probs_diff_{max,mean,std}`` over every token in ``diffs``
    (std with Bessel's correction, as torch.std in verl; 0 below two tokens, where verl's
    would be NaN, and all 0 with no token, so every step carries the same keys)."""
    gaps = torch.cat([d.reshape(-1) for d in diffs]) if diffs else torch.zeros(0)
    n = gaps.numel()
    return {
        "training/rollout_probs_diff_max": float(gaps.max()) if n else 0.0,
        "training/rollout_probs_diff_mean": float(gaps.mean()) if n else 0.0,
        "training/rollout_probs_diff_std": float(gaps.std()) if n > 1 else 0.0,
    }


def _is_weight_metrics(raw: torch.Tensor, seq_raw: torch.Tensor, seq_applied: torch.Tensor,
                      cap: float) -> dict[str, float]:
    """verl's token-level ``rollout_corr/rollout_is_*`` figures (its
    ``compute_is_metrics``) of the truncated importance weights a step's loss applied:
    ``raw`` every weighted response token's pi_prox / pi_rollout before truncation [N],
    ``seq_raw`` / ``seq_applied`` each weighted sequence's mean raw and truncated weight
    [S]; ``cap`` the truncation (trainer.tis_cap, verl's rollout_is_threshold; the lower
    threshold is its reciprocal, as verl's default). Empty with no weighted token."""
    if raw.numel() == 0:
        return {}
    raw, seq_raw, seq_applied = raw.double(), seq_raw.double(), seq_applied.double()
    applied = raw.clamp(max=cap)
    low = 1.0 / cap
    mean = float(applied.mean())
    var = max(float(applied.square().mean()) - mean * mean, 0.0)
    normalised = applied / (mean + 1e-8)
    p = "rollout_corr/rollout_is"
    return {
        f"{p}_mean": mean,
        f"{p}_ratio_fraction_high": float((raw > cap).double().mean()),
        f"{p}_ratio_fraction_low": float((raw < low).double().mean()),
        f"{p}_max": float(applied.max()),
        f"{p}_min": float(applied.min()),
        f"{p}_std": var ** 0.5 if raw.numel() > 1 else 0.0,
        f"{p}_eff_sample_size": float(1.0 / normalised.square().mean()),
        f"{p}_seq_mean": float(seq_applied.mean()),
        f"{p}_seq_std": float(seq_applied.std()) if seq_applied.numel() > 1 else 0.0,
        f"{p}_seq_max": float(seq_applied.max()),
        f"{p}_seq_min": float(seq_applied.min()),
        f"{p}_seq_max_deviation": float((seq_applied - 1.0).abs().max()),
        f"{p}_seq_fraction_high": float((seq_raw > cap).double().mean()),
        f"{p}_seq_fraction_low": float((seq_raw < low).double().mean()),
    }


@torch.no_grad()
def _shrink(params: Sequence[torch.Tensor], before: Sequence[torch.Tensor],
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
    measure: Callable[[], torch.Tensor] | None = None,
    group: RankGroup | None = None,
) -> tuple[float, bool]:
    """``optimizer.step()`` with a KL guard (``trainer.kl_guard``): if the step moved the
    policy by more than ``max_kl`` (approx KL, token mean over ``batch``, against ``logp``,
    the log-probs this step's gradient was taken at), pull it back: parameters towards
    where they were and Adam's first moment by the same factor, until it fits.

    A near-deterministic policy is sharp: one clipped-gradient Adam step can move it by a
    KL of 0.1-1 (the PPO clip acts only on later mini-batches, too late), and Adam's
    momentum keeps moving the same way on the next mini-batches even when their gradient
    is ~0. Returns (the step's KL, whether it was shrunk); max_kl None: a plain step.
    ``measure``: the policy's log-probs on ``batch`` now, without grad (default: one forward
    of the whole batch; micro-batched steps pass theirs). ``group``: the trainer's ranks,
    each holding its share of the mini-batch; the KL is then the token mean over all of
    them, so every rank decides alike."""
    if max_kl is None:
        optimizer.step()
        return 0.0, False
    params = [p for p in policy.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    optimizer.step()
    shrunk = False
    logp = logp.detach()
    for _ in range(_GUARD_TRIES):
        if measure is not None:
            new = measure()
        else:
            with torch.no_grad():
                new, _ = policy.logprobs_and_entropy(  # type: ignore[operator]
                    batch.input_ids, batch.attention_mask, batch.response_len,
                    temperature=temperature,
                )
        kl = _global_kl(new, logp, batch.response_mask, group)
        if kl <= max_kl:
            break
        # KL grows about quadratically with the step: aim just inside the bound.
        _shrink(params, before, optimizer, min(0.5, (max_kl / kl) ** 0.5))
        shrunk = True
    return kl, shrunk


def _kl_sums(logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor
             ) -> torch.Tensor:
    """[sum over masked tokens of approx_kl's k3 estimate, their count]."""
    d = (logp_old - logp_new).detach()
    m = mask.to(d.dtype)
    return torch.stack([((torch.exp(-d) - 1 + d) * m).sum(), m.sum()]).cpu()


def _global_kl(logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor,
               group: RankGroup | None) -> float:
    """approx_kl over the masked tokens of every rank (one rank: approx_kl itself)."""
    if group is None or not group.active:
        return float(approx_kl(logp_new, logp_old, mask))
    total, count = group.sum(_kl_sums(logp_new, logp_old, mask)).tolist()
    return total / max(count, 1.0)


class LateStaleMiniBatch(RuntimeError):
    """A stale mini-batch was added after the step's first optimizer step."""


class _MiniBatch(NamedTuple):
    batch: Batch
    # Log-probs the PPO ratio is taken against. None: the proximal log-probs of the step's
    # first mini-batch, taken from its own first forward (no optimizer step has run yet).
    old: torch.Tensor | None
    adv: torch.Tensor
    stale: bool
    live: torch.Tensor  # [B] bool: the sample's group has unequal rewards (non-zero advantages)
    micro: list[Rows]  # its micro-batches (gradient accumulation)
    # The whole mini-batch's (all ranks' rows): every group of equal rewards / none; its
    # response tokens, and those of groups with unequal rewards (token-mean denominators).
    dead: bool
    all_live: bool
    tokens: float
    live_tokens: float
    # Micro-batches every rank runs (the most any rank has): a rank with fewer runs its last
    # one again, weighted 0, so FSDP's collectives pair up.
    n_micro: int
    ref: torch.Tensor | None = None  # [B, R] the reference's log-probs (use_kl_loss), once
    # [B, R] the tokens verl's rejection sampling keeps (trainer.rollout_rs), or None.
    keep: torch.Tensor | None = None
    # Its loss weights each token by min(pi_old / pi_rollout, tis_cap) (decoupled PPO).
    weighted: bool = False


class _Micro(NamedTuple):
    """One micro-batch: its rows of the mini-batch and their (trimmed) batch; ``pad``: a
    repeat that only keeps the ranks' collectives paired (weighted 0, results unused)."""

    rows: Rows
    batch: Batch
    pad: bool = False

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """The micro-batch's part of a mini-batch tensor [B] or [B, R]."""
        x = x[self.rows]
        return x[:, : self.batch.response_len] if x.dim() == 2 else x


_STATS = ("loss", "clip", "kll", "pg", "clipl", "pkl", "ent_sum", "ent_n", "kl_sum", "kl_n")
"""Per-rank sums in a step's stats, added up over the ranks at its end."""


class _Acc(NamedTuple):
    """A mini-batch's losses, summed over its micro-batches (each a share of the mean)."""

    loss: float = 0.0
    clipfrac: float = 0.0
    kl_loss: float = 0.0
    pg_loss: float = 0.0
    clipfrac_lower: float = 0.0
    ppo_kl: float = 0.0

    def add(self, w: float, loss: torch.Tensor, pg: PolicyLoss, kl_loss: torch.Tensor
            ) -> _Acc:
        """These sums plus one micro-batch's figures, weighted by its share ``w`` (one
        transfer from the device for all six)."""
        figures = torch.stack([t.detach().float() for t in (
            loss, pg.clipfrac, kl_loss, pg.loss, pg.clipfrac_lower, pg.ppo_kl)]).tolist()
        return _Acc(*(a + f * w for a, f in zip(self, figures, strict=True)))


class GrpoStep:
    """One training step: group-normalised advantages, PPO-clip against the rollout
    log-probs, decoupled PPO with truncated importance weights (``tc.tis_cap``) for
    mini-batches holding samples older than ``version``, entropy bonus, grad clipping, one
    optimizer step per mini-batch and epoch, each bounded by the KL guard (``tc.kl_guard``,
    see :func:`guarded_step`), with the KL loss to ``reference`` (``tc.use_kl_loss``).

    A mini-batch's gradient is accumulated over micro-batches (``tc.micro_batch_size``
    responses, or with ``tc.use_dynamic_bsz`` packs of at most ``tc.max_token_len``
    tokens): each micro-batch's token-mean loss is weighted by its share of the
    mini-batch's tokens, so the sum is the mini-batch's token mean, as verl's token-mean
    with the global token count. ``scheduler`` (the lr schedule) advances once per step,
    in :meth:`finish`: verl's unit, one ``lr_scheduler.step()`` per training step.

    :meth:`add` prepares a mini-batch, :meth:`train` runs the first epoch of those not yet
    trained, :meth:`finish` runs what is left (the first epoch of the rest, then epochs 2..)
    and returns the step's metrics. Epoch order is the order of :meth:`add`.

    The metrics include verl's ``training/rollout_probs_diff_{max,mean,std}``: |p_rollout -
    p_trainer| per response token, p_trainer on the weights the step starts from, over the
    mini-batches whose log-probs on those weights the step computes anyway
    (:meth:`_rollout_gap`; docs/training.md)."""

    def __init__(
        self,
        policy: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        tc: TrainerConfig,
        *,
        temperature: float,
        version: int,
        device: torch.device | str,
        reference: torch.nn.Module | None = None,
        scheduler: Any = None,
        group: RankGroup | None = None,
    ) -> None:
        self.policy, self.optimizer, self.tc = policy, optimizer, tc
        self.group = group or RankGroup(None, torch.device(device), 0.0)
        self.temperature, self.version, self.device = temperature, version, device
        self.reference = reference if tc.use_kl_loss else None
        if tc.use_kl_loss and reference is None:
            raise ValueError("trainer.use_kl_loss needs a reference policy")
        self.scheduler = scheduler
        self.rules = rejection_rules(tc.rollout_rs, tc.rollout_rs_threshold)
        self.rejected = [0.0] * (3 + 2 * len(self.rules))
        """Over the step, every rank: response tokens rejected, sequences with a token
        rejected, sequences, then each rule's own tokens and sequences rejected (verl's
        ``rollout_corr/rollout_rs_*masked_fraction``, all and per option)."""
        self.groups: list[Sequence[Sample]] = []
        self.advantages: list[float] = []
        """Each sample's advantage, in the order of :attr:`groups` (verl's critic/*)."""
        self.minibatches: list[_MiniBatch] = []
        self.trained = 0  # mini-batches whose first epoch is done
        # Tokens per rank over the step: split as balance_batch=false would, and as trained.
        self.seqlen = ([0] * self.group.world, [0] * self.group.world)
        self.stats: dict[str, list[float]] = {
            k: [] for k in (*_STATS, "gn", "ukl", "guard", "zero")
        }
        self.moved = False  # an optimizer step of this step has changed the weights
        # |p_rollout - p_trainer| per response token of the mini-batches whose log-probs on
        # the step's starting weights were computed anyway (see _rollout_gap), by index.
        self.gaps: dict[int, torch.Tensor] = {}

    def add(self, groups: Sequence[Sequence[Sample]]) -> None:
        """Prepare one mini-batch: ``groups``, each the ``n`` responses of one prompt."""
        if not groups:
            return
        flat = [s for group in groups for s in group]
        stale = any(s.min_version < self.version for s in flat)
        use_tis = self.tc.tis_cap is not None and (stale or bool(self.rules))
        if (use_tis or self.rules) and self.trained:
            older = f"with samples older than v{self.version} " if stale else ""
            raise LateStaleMiniBatch(
                f"a mini-batch {older}came after {self.trained} optimizer step(s): its "
                "proximal log-probs need the weights the step started from")
        rewards = torch.tensor([[s.reward for s in group] for group in groups])
        whole = build_batch(
            # Views on the message bytes: build_batch copies them into its tensors.
            [(s.prompt_tokens.numpy(), s.response_tokens.numpy(), s.logprobs.numpy())
             for s in flat],
            pad_id=self.policy.pad_id,  # type: ignore[arg-type]
            device=self.device,
            masks=[None if s.response_mask is None else s.response_mask.numpy()
                   for s in flat],
        )
        adv_g = group_advantages(rewards)
        advantages = adv_g.reshape(-1).tolist()
        live = (adv_g != 0).any(dim=1, keepdim=True).expand_as(adv_g).reshape(-1)
        adv = adv_g.reshape(-1).to(self.device)
        live = live.to(self.device)
        tokens = float(whole.response_mask.sum())
        live_tokens = float(
            (whole.response_mask * live[:, None].to(whole.response_mask.dtype)).sum())
        dead, all_live = not bool(live.any()), bool(live.all())
        batch = whole
        if self.group.active:  # this rank's share of the rows (the same split on a replay)
            rows = self._share(whole)
            batch = whole.select(torch.tensor(rows, device=whole.input_ids.device))
            adv, live = adv[rows], live[rows]
        old: torch.Tensor | None = batch.old_logprobs
        keep = None
        if self.rules:
            # verl's rejection sampling needs every mini-batch's log-probs on the step's
            # starting weights (verl's old_log_prob); the ratio is then taken against them,
            # as verl's decoupled mode does (the step does not stream: core._feed).
            with torch.no_grad():
                old, _ = self.policy.logprobs_and_entropy(  # type: ignore[operator]
                    batch.input_ids, batch.attention_mask, batch.response_len,
                    temperature=self.temperature,
                )
            self._rollout_gap(len(self.minibatches), old, batch)
            keeps = rule_keeps(old, batch.old_logprobs, batch.response_mask, self.rules)
            keep = kept_by_all(batch.response_mask, keeps)
            tokens, live_tokens = self._kept(batch, keep, live, keeps)
        elif use_tis and not self.minibatches:
            old = None  # the first mini-batch: its training forward gives them, for free
        elif use_tis:
            # Decoupled PPO for stale samples: the ratio is taken against the current
            # (proximal) weights and the rollout policy enters only through a truncated
            # importance weight, so a very stale sample cannot dominate the step.
            with torch.no_grad():
                old, _ = self.policy.logprobs_and_entropy(  # type: ignore[operator]
                    batch.input_ids, batch.attention_mask, batch.response_len,
                    temperature=self.temperature,
                )
            # No optimizer step yet (checked above): the step's starting weights.
            self._rollout_gap(len(self.minibatches), old, batch)
        micro = self._split(batch)
        self.groups.extend(groups)
        self.advantages.extend(advantages)
        self.minibatches.append(_MiniBatch(
            batch, old, adv, stale, live, micro, dead=dead, all_live=all_live,
            tokens=tokens, live_tokens=live_tokens,
            n_micro=self.group.max_int(len(micro)), keep=keep, weighted=use_tis))

    def _kept(self, batch: Batch, keep: torch.Tensor, live: torch.Tensor,
              keeps: Sequence[torch.Tensor]) -> tuple[float, float]:
        """The response tokens rejection sampling kept, and those of them in groups with
        unequal rewards, over every rank (the token-mean denominators, as verl's loss over
        its modified response mask); counts what it rejected for the step's figures, all
        rules together and (``keeps``) each rule's own."""
        mask = batch.response_mask
        kept = mask * keep
        rows = mask.sum(dim=-1) > 0

        def rejected(k: torch.Tensor) -> list[torch.Tensor]:
            """Response tokens ``k`` drops, and rows where it drops one."""
            dropped = mask * (1 - k.to(mask.dtype))
            return [dropped.sum(), ((dropped.sum(dim=-1) > 0) & rows).sum()]

        counts = self.group.sum(torch.stack([
            kept.sum(), (kept * live[:, None].to(kept.dtype)).sum(), *rejected(keep),
            torch.tensor(float(len(rows)), device=mask.device),
            *(c for k in keeps for c in rejected(k))]).double().cpu()).tolist()
        self.rejected = [a + b for a, b in zip(self.rejected, counts[2:], strict=True)]
        return counts[0], counts[1]

    def _share(self, whole: Batch) -> list[int]:
        """This rank's rows of a mini-batch (trainer.rowsplit: balanced by tokens with
        trainer.balance_batch), counting every rank's tokens for ``global_seqlen/*``."""
        world = self.group.world
        tokens = whole.token_counts().tolist()
        strided = strided_rows(len(tokens), world)
        parts = balanced_rows(tokens, world) if self.tc.balance_batch else strided
        for totals, split in zip(self.seqlen, (strided, parts), strict=True):
            for rank, load in enumerate(rank_loads(tokens, split)):
                totals[rank] += load
        return parts[self.group.rank]

    def _split(self, batch: Batch) -> list[Rows]:
        """The micro-batches of ``batch``: the whole of it unless micro_batch_size or
        use_dynamic_bsz asks for more than one."""
        tc = self.tc
        if tc.micro_batch_size is None and not tc.use_dynamic_bsz:
            return [slice(None)]
        counts = batch.token_counts().tolist()
        parts = micro_batches(counts, tc.micro_batch_size,
                              tc.max_token_len if tc.use_dynamic_bsz else None)
        return [slice(None)] if len(parts) == 1 else list(parts)

    def _micros(self, mb: _MiniBatch) -> list[_Micro]:
        micros = [_Micro(rows, mb.batch if isinstance(rows, slice) else mb.batch.select(rows))
                  for rows in mb.micro]
        return micros + [micros[-1]._replace(pad=True)] * (mb.n_micro - len(micros))

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, mb: _MiniBatch
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """``model``'s log-probs and entropies [B, R] on ``mb``, micro-batch by micro-batch,
        without grad."""
        parts = [(m, *model.logprobs_and_entropy(  # type: ignore[operator]
            m.batch.input_ids, m.batch.attention_mask, m.batch.response_len,
            temperature=self.temperature)) for m in self._micros(mb)]
        parts = [p for p in parts if not p[0].pad]
        if len(parts) == 1 and isinstance(parts[0][0].rows, slice):
            return parts[0][1], parts[0][2]
        return _scatter(mb.batch.response_mask, parts)

    def _reference(self, i: int) -> torch.Tensor:
        """The reference's log-probs on mini-batch ``i`` (taken once, kept for its epochs)."""
        mb = self.minibatches[i]
        if mb.ref is None:
            assert self.reference is not None
            mb = self.minibatches[i] = mb._replace(ref=self._logprobs(self.reference, mb)[0])
        assert mb.ref is not None
        return mb.ref

    def _optimize(self, i: int) -> None:
        mb, tc = self.minibatches[i], self.tc
        mode = tc.zero_adv
        dead = mb.dead  # every group of equal rewards (on every rank): advantages all 0
        self.stats["zero"].append(float(dead))
        if dead and mode in ("skip", "drop"):
            # No policy-gradient signal: no optimizer step at all (Adam's moments and step
            # count stay as they are; a zero-gradient Adam step would still move the
            # parameters by its momentum, and the entropy bonus alone is scaled by Adam to a
            # full-size step).
            logp, entropy = self._logprobs(self.policy, mb)
            mb = self._proximal(i, logp)
            if not self.moved:
                self._rollout_gap(i, logp, mb.batch)
            self._record(mb, logp, entropy, _Acc(), grad_norm=0.0, update_kl=0.0,
                         shrunk=False)
            return
        mask, total = mb.batch.response_mask, mb.tokens
        if mb.keep is not None:  # verl's rejection sampling: only the kept tokens train
            mask = mask * mb.keep
        if mode == "drop" and not mb.all_live:
            # DAPO-style: groups of equal rewards leave the token mean (their policy-gradient
            # term is 0; they would only dilute the others' and add entropy pressure).
            mask, total = mask * mb.live[:, None].to(mask.dtype), mb.live_tokens
        ref = self._reference(i) if self.reference is not None else None
        self.optimizer.zero_grad(set_to_none=True)
        bonus = bool(tc.entropy_coeff) and not (dead and mode == "no_entropy")
        logp, entropy, acc = self._backward(mb, mask, total, ref, bonus)
        mb = self._proximal(i, logp)
        if not self.moved:
            self._rollout_gap(i, logp, mb.batch)
        self.moved = True  # the step below changes the weights (the guard never undoes it all)
        reduce_gradients(self.policy, tc, self.group)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), tc.grad_clip)
        if isinstance(grad_norm, DTensor):  # FSDP2: the norm over every rank's shard
            grad_norm = grad_norm.full_tensor()
        measure = (None if mb.n_micro == 1 else
                   lambda: self._logprobs(self.policy, self.minibatches[i])[0])
        update_kl, shrunk = guarded_step(self.policy, self.optimizer, mb.batch, logp,
                                         tc.kl_guard, temperature=self.temperature,
                                         measure=measure, group=self.group)
        self._record(mb, logp, entropy, acc, grad_norm=float(grad_norm), update_kl=update_kl,
                     shrunk=shrunk)

    def _backward(self, mb: _MiniBatch, mask: torch.Tensor, total: float,
                  ref: torch.Tensor | None, bonus: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, _Acc]:
        """Gradients of the mini-batch's loss, accumulated micro-batch by micro-batch; its
        log-probs and entropies [B, R] (detached) and summed losses. ``total``: the tokens
        of ``mask`` on every rank (each rank's gradient is its share of the mean; the ranks'
        gradients are summed)."""
        total_t = torch.tensor(max(total, 1.0), device=mask.device)
        parts, acc = [], _Acc()
        for m in self._micros(mb):
            logp, entropy = self.policy.logprobs_and_entropy(  # type: ignore[operator]
                m.batch.input_ids, m.batch.attention_mask, m.batch.response_len,
                temperature=self.temperature,
            )
            sub = m.cut(mask)
            # Token-mean of the whole mini-batch: each micro-batch's mean weighted by its
            # share of the tokens (exactly 1.0 for a single micro-batch: same numbers).
            share = sub.sum() / total_t
            loss, pg, kl_loss = self._loss(mb, m, logp, entropy, sub, ref, bonus)
            if m.pad:  # only FSDP's collectives: no gradient, no figures
                (loss * 0.0).backward()
                continue
            (loss * share).backward()
            acc = acc.add(float(share), loss, pg, kl_loss)
            parts.append((m, logp.detach(), entropy.detach()))  # the graph is spent
        if len(parts) == 1 and isinstance(parts[0][0].rows, slice):
            return parts[0][1], parts[0][2], acc
        return (*_scatter(mb.batch.response_mask, parts), acc)

    def _loss(self, mb: _MiniBatch, m: _Micro, logp: torch.Tensor, entropy: torch.Tensor,
              mask: torch.Tensor, ref: torch.Tensor | None, bonus: bool
              ) -> tuple[torch.Tensor, PolicyLoss, torch.Tensor]:
        """One micro-batch's loss (token means over ``mask``), its policy-gradient part
        and KL loss: PPO clip with the dual-clip bound (+ TIS for stale samples) - entropy
        bonus + kl_loss_coef x KL."""
        tc = self.tc
        # The step's first stale mini-batch has no proximal log-probs yet: this forward's,
        # taken before the step's first optimizer step, are they.
        old = m.cut(mb.old) if mb.old is not None else logp.detach()
        use_tis = mb.weighted
        pg = policy_loss(
            logp, old, m.cut(mb.adv), mask, tc.clip_ratio_low, tc.clip_ratio_high,
            logp_behaviour=m.batch.old_logprobs if use_tis else None,
            tis_cap=tc.tis_cap if use_tis else None, clip_ratio_c=tc.clip_ratio_c,
        )
        loss = pg.loss
        if bonus:
            loss = loss - tc.entropy_coeff * masked_mean(entropy, mask)
        kl_loss = torch.zeros(())
        if ref is not None:
            kl_loss = masked_mean(kl_penalty(logp, m.cut(ref), tc.kl_loss_type), mask)
            loss = loss + tc.kl_loss_coef * kl_loss
        return loss, pg, kl_loss.detach()

    def _proximal(self, i: int, logp: torch.Tensor) -> _MiniBatch:
        """Mini-batch ``i`` with its proximal log-probs: if deferred (the step's first
        mini-batch), this forward's, before any optimizer step of the step."""
        mb = self.minibatches[i]
        if mb.old is None:
            mb = self.minibatches[i] = mb._replace(old=logp.detach())
        return mb

    def _rollout_gap(self, i: int, logp: torch.Tensor, batch: Batch) -> None:
        """Keep mini-batch ``i``'s |p_rollout - p_trainer| over its response tokens, once,
        from ``logp``: its log-probs on the weights the step started from.

        Only where those are computed anyway: the forward of every mini-batch trained before
        the step's first optimizer step (the first one at least) and the proximal log-probs
        of stale mini-batches (decoupled PPO, taken in :meth:`add`). A later mini-batch's
        step-start log-probs would cost a forward of their own, and a streamed step no
        longer has those weights when the mini-batch arrives; which mini-batches are covered
        depends only on their order, so a streamed step and :func:`grpo_update` agree."""
        if i not in self.gaps:
            self.gaps[i] = probs_diff(logp, batch.old_logprobs, batch.response_mask)

    def _record(self, mb: _MiniBatch, logp: torch.Tensor, entropy: torch.Tensor, acc: _Acc,
                *, grad_norm: float, update_kl: float, shrunk: bool) -> None:
        """One optimizer step's stats; entropy and KL over the whole mini-batch (this
        rank's sums and token counts: :meth:`_reduced` adds up the ranks')."""
        mask = mb.batch.response_mask
        assert mb.old is not None
        m = mask.to(entropy.dtype)
        kl_sum, kl_count = _kl_sums(logp, mb.old, mask).tolist()
        st = self.stats
        st["ukl"].append(update_kl)
        st["guard"].append(float(shrunk))
        st["gn"].append(grad_norm)
        for key, value in (("loss", acc.loss), ("clip", acc.clipfrac), ("kll", acc.kl_loss),
                           ("pg", acc.pg_loss), ("clipl", acc.clipfrac_lower),
                           ("pkl", acc.ppo_kl),
                           ("ent_sum", float((entropy.detach() * m).sum())),
                           ("ent_n", float(m.sum())), ("kl_sum", kl_sum), ("kl_n", kl_count)):
            st[key].append(value)

    def _reduced(self) -> dict[str, list[float]]:
        """The step's per-rank stats summed over the ranks (one all_reduce), and the
        per-optimizer-step entropy and KL means from them."""
        st = dict(self.stats)
        k = len(st["loss"])
        if self.group.active and k:
            flat = torch.tensor([v for key in _STATS for v in st[key]], dtype=torch.float64)
            summed = self.group.sum(flat).tolist()
            for j, key in enumerate(_STATS):
                st[key] = summed[j * k:(j + 1) * k]
        st["ent"] = [s / max(n, 1.0) for s, n in zip(st["ent_sum"], st["ent_n"], strict=True)]
        st["kl"] = [s / max(n, 1.0) for s, n in zip(st["kl_sum"], st["kl_n"], strict=True)]
        return st

    def _gaps(self) -> list[torch.Tensor]:
        """Every rank's |p_rollout - p_trainer| tokens, in rank order."""
        mine = [self.gaps[i].cpu() for i in sorted(self.gaps)]
        if not self.group.active:
            return mine
        return [t for rank in self.group.gather(mine) for t in rank]

    def _is_metrics(self) -> dict[str, float]:
        """verl's ``rollout_corr/rollout_is_*`` over the tokens this step's loss weighted
        by a truncated importance weight (decoupled PPO: stale samples, or every mini-batch
        with rejection sampling), every rank's; none in a step that weighted none."""
        cap = self.tc.tis_cap
        if cap is None:
            return {}
        mine: list[torch.Tensor] = []
        for mb in self.minibatches:
            if not mb.weighted or mb.old is None:
                continue
            log_ratio = (mb.old - mb.batch.old_logprobs).float().clamp(-SAFETY_BOUND,
                                                                       SAFETY_BOUND)
            raw, m = torch.exp(log_ratio), mb.batch.response_mask.to(torch.float32)
            rows = m.sum(dim=-1) > 0
            count = m.sum(dim=-1).clamp(min=1.0)
            mine += [raw[m.bool()].cpu(), ((raw * m).sum(dim=-1) / count)[rows].cpu(),
                     ((raw.clamp(max=cap) * m).sum(dim=-1) / count)[rows].cpu()]
        every = [t for rank in self.group.gather(mine) for t in rank]
        if not every:
            return {}
        return _is_weight_metrics(torch.cat(every[0::3]), torch.cat(every[1::3]),
                                  torch.cat(every[2::3]), cap)

    def _rejection_metrics(self) -> dict[str, float]:
        """verl's ``rollout_corr/rollout_rs_masked_fraction`` (response tokens rejected) and
        ``rollout_rs_seq_masked_fraction`` (sequences with a token rejected), over the step;
        none without rejection sampling."""
        if not self.rules:
            return {}
        kept = sum(mb.tokens for mb in self.minibatches)
        dropped, seqs_hit, seqs, *each = self.rejected
        tokens, seqs = max(dropped + kept, 1.0), max(seqs, 1.0)
        out = {"rollout_corr/rollout_rs_masked_fraction": dropped / tokens,
               "rollout_corr/rollout_rs_seq_masked_fraction": seqs_hit / seqs}
        for rule, rule_tokens, rule_seqs in zip(self.rules, each[::2], each[1::2],
                                                 strict=True):
            name = f"rollout_corr/rollout_rs_{rule.option}"
            out[f"{name}_masked_fraction"] = rule_tokens / tokens
            out[f"{name}_seq_masked_fraction"] = rule_seqs / seqs
        return out

    def train(self) -> None:
        """First epoch of every mini-batch added and not yet trained."""
        while self.trained < len(self.minibatches):
            self._optimize(self.trained)
            self.trained += 1

    def finish(self) -> dict[str, float]:
        """Train what is left, advance the lr schedule and return the step's metrics
        (``actor/lr``: the learning rate this step trained with)."""
        self.train()
        for _ in range(1, self.tc.ppo_epochs):
            for i in range(len(self.minibatches)):
                self._optimize(i)
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.scheduler is not None:
            self.scheduler.step()
        flat_all = [s for group in self.groups for s in group]
        rewards = [s.reward for s in flat_all]
        staleness = [self.version - s.min_version for s in flat_all]
        # The tokens each sample trained (verl's critic/advantages are over its response
        # mask: a multi-turn response's tool output leaves them out).
        trained = [len(s.response_tokens) if s.response_mask is None
                   else int(s.response_mask.numpy().sum()) for s in flat_all]
        st, tc = self._reduced(), self.tc
        return {
            "staleness/mean": _mean(staleness),
            "staleness/max": float(max(staleness)) if staleness else 0.0,
            "staleness/stale_share": _mean([float(x > 0) for x in staleness]),
            "actor/loss": _mean(st["loss"]),
            "actor/pg_loss": _mean(st["pg"]),
            "actor/pg_clipfrac": _mean(st["clip"]),
            "actor/pg_clipfrac_lower": _mean(st["clipl"]),
            "actor/ppo_kl": _mean(st["pkl"]),
            "actor/entropy": _mean(st["ent"]),
            "actor/grad_norm": _mean(st["gn"]),
            "actor/approx_kl": _mean(st["kl"]),
            **({"actor/update_kl_max": max(st["ukl"], default=0.0),
                "actor/kl_guard_frac": _mean(st["guard"])} if tc.kl_guard is not None else {}),
            **({"actor/zero_adv_frac": _mean(st["zero"])} if tc.zero_adv != "keep" else {}),
            **({"actor/kl_loss": _mean(st["kll"]), "actor/kl_coef": tc.kl_loss_coef}
               if self.reference is not None else {}),
            "actor/lr": lr,
            **critic_metrics(rewards, self.advantages, trained),
            **self._rejection_metrics(),
            **_probs_diff_metrics(self._gaps()),
            **self._is_metrics(),
            **(seqlen_metrics(*self.seqlen) if self.group.active and tc.balance_batch else {}),
            **extra_metrics(s.reward_extra for s in flat_all),
        }


def grpo_update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: Sequence[Sequence[Sample]],
    tc: TrainerConfig,
    *,
    temperature: float,
    version: int,
    device: torch.device | str,
    reference: torch.nn.Module | None = None,
    scheduler: Any = None,
    group: RankGroup | None = None,
) -> dict[str, float]:
    """Train on ``groups`` (each the ``n`` responses of one prompt, in index order) as one
    :class:`GrpoStep`, every mini-batch added before the first optimizer step. Returns the
    step's metrics."""
    step = GrpoStep(policy, optimizer, tc, temperature=temperature, version=version,
                    device=device, reference=reference, scheduler=scheduler, group=group)
    mb = tc.ppo_mini_batch_size
    for start in range(0, len(groups), mb):
        step.add(groups[start : start + mb])
    return step.finish()


def _scatter(response_mask: torch.Tensor, parts: Sequence[tuple[_Micro, torch.Tensor,
                                                                torch.Tensor]]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batches' per-token tensors back into the mini-batch's [B, R] (0 at pads)."""
    logp = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    ent = torch.zeros_like(logp)
    for m, lp, e in parts:
        idx = torch.as_tensor(m.rows, device=logp.device) if isinstance(m.rows, list) else m.rows
        r = m.batch.response_len
        logp[idx, :r] = lp.float()
        ent[idx, :r] = e.float()
    return logp, ent

