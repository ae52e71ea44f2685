"""The trainer's model: the policy, its optimizer and lr schedule, the frozen reference of
the KL loss, and the weights version they hold.

Every method that touches torch is blocking: the trainer calls them on its worker thread
(:meth:`runtime.Component.off`), so its event loop stays free for the lease and the pulse, and
torch.profiler sees every profiled call on the thread it was started on.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
from torch.optim.lr_scheduler import LambdaLR

from bus.messages import Sample
from policy import build_policy, resolve_device
from runconfig import Config, TrainerConfig
from runtime import settle_heap
from trainer.update import GrpoStep, grpo_update

__all__ = ["Learner", "frozen_copy", "lr_factor", "make_optimizer", "warmup_steps"]

_SCHEDULER_KEY = "lr_scheduler"
"""Where the lr schedule's state rides in the optimizer's state dict (so in checkpoints)."""


def warmup_steps(tc: TrainerConfig) -> int:
    """verl's warm-up length: ``lr_warmup_steps``, or when that is <= 0 (-1 by default)
    ``int(lr_warmup_steps_ratio x total_training_steps)``, in training steps."""
    if tc.lr_warmup_steps > 0:
        return tc.lr_warmup_steps
    return int(tc.lr_warmup_steps_ratio * tc.total_training_steps)


def lr_factor(step: int, tc: TrainerConfig) -> float:
    """The lr multiplier of training step ``step`` (0 = the first), verl's formulas
    (verl.utils.torch_functional, zero-indexed steps): a linear warm-up step / warm-up from
    0, then constant 1, or cosine: max(min_lr_ratio, (1 + min_lr_ratio) / 2 + (1 -
    min_lr_ratio) / 2 x cos(2 pi num_cycles progress)), progress = (step - warm-up) /
    (total_training_steps - warm-up)."""
    warm = warmup_steps(tc)
    if step < warm:
        return float(step) / float(max(1, warm))
    if tc.lr_scheduler_type == "constant":
        return 1.0
    progress = float(step - warm) / float(max(1, tc.total_training_steps - warm))
    x = math.cos(math.pi * float(tc.num_cycles) * 2.0 * progress)
    return max(tc.min_lr_ratio, x * (1 - tc.min_lr_ratio) * 0.5 + (1 + tc.min_lr_ratio) * 0.5)


def make_optimizer(params: Any, tc: TrainerConfig
                   ) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW (verl's: betas 0.9 / 0.999, decoupled ``weight_decay`` on every parameter) and
    its lr schedule (:func:`lr_factor`, one ``step()`` per training step).

    The schedule's state is saved inside the optimizer's state dict (key
    ``lr_scheduler``) and restored by ``optimizer.load_state_dict``, so a checkpoint of the
    optimizer carries it and a resume continues the schedule where it was."""
    optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.999),
                                  weight_decay=tc.weight_decay)
    scheduler = LambdaLR(optimizer, _factor_of(tc))
    _carry_scheduler(optimizer, scheduler)
    return optimizer, scheduler


def _factor_of(tc: TrainerConfig) -> Callable[[int], float]:
    return lambda step: lr_factor(step, tc)


def _carry_scheduler(optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> None:
    loaded: list[dict[str, Any]] = []

    def save(_opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        state[_SCHEDULER_KEY] = scheduler.state_dict()
        return state

    def take(_opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        state = dict(state)
        if (sched := state.pop(_SCHEDULER_KEY, None)) is not None:
            loaded.append(sched)
        return state

    def restore(_opt: torch.optim.Optimizer) -> None:
        if loaded:  # a checkpoint written without a schedule leaves it where it is
            scheduler.load_state_dict(loaded.pop())

    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(take)
    optimizer.register_load_state_dict_post_hook(restore)


def frozen_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``policy`` that is never trained (the KL loss's reference): no gradients,
    eval mode for good."""
    ref = copy.deepcopy(policy)
    ref.requires_grad_(False)
    ref.eval()
    return ref


def _vocab_size(policy: torch.nn.Module) -> int | None:
    sizes = [m.num_embeddings for m in policy.modules() if isinstance(m, torch.nn.Embedding)]
    return max(sizes) if sizes else None


def publish_dtype(cfg: Config) -> torch.dtype | None:
    """The dtype weights are published in (``rollout.weights_dtype``): ``auto`` is the
    rollouter's model dtype (bf16 for an HF model of ``model.dtype`` bf16; the trainer's own
    dtype otherwise, None: unchanged)."""
    want = cfg.rollout.weights_dtype
    if want == "auto":
        hf_bf16 = cfg.model.kind == "hf" and cfg.model.dtype in ("bf16", "bfloat16")
        return torch.bfloat16 if hf_bf16 else None
    return torch.bfloat16 if want == "bf16" else torch.float32


class Learner:
    """The policy being trained, its optimizer and its weights version."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.trainer.device)
        self.version = 0
        """The weights version the policy holds (one more after every sync)."""
        self.vocab_size: int | None = None
        self.max_len: int | None = cfg.model.max_len if cfg.model.kind == "tiny" else None
        self.building: asyncio.Future[None] | None = None  # the optimizer, see build_optimizer
        self.reference: torch.nn.Module | None = None
        """use_kl_loss: the initial weights, frozen (see :meth:`build`)."""
        self.scheduler: LambdaLR | None = None

    def build(self) -> None:
        """The policy, and with ``use_kl_loss`` its frozen reference (blocking).

        The reference is a copy of the weights as built from the model config (model.path,
        or the tiny model's seed), taken before any checkpoint is loaded: a resumed trainer
        rebuilds the very same reference."""
        tc = self.cfg.trainer
        torch.set_num_threads(tc.threads)
        torch.manual_seed(tc.seed)
        self.policy = build_policy(msgspec.to_builtins(self.cfg.model), self.device,
                                   training=True)
        self.policy.train()
        self.reference = frozen_copy(self.policy) if tc.use_kl_loss else None
        self.vocab_size = _vocab_size(self.policy)

    def build_optimizer(self) -> None:
        """Start building the optimizer on a thread of its own: the first torch optimizer of a
        process imports torch._dynamo (about a second), while the worker serialises weights
        version 0. :meth:`optimizer_ready` waits for it."""
        def build() -> None:
            self.optimizer, self.scheduler = make_optimizer(self.policy.parameters(),
                                                            self.cfg.trainer)

        self.building = asyncio.ensure_future(asyncio.to_thread(build))

    async def optimizer_ready(self) -> None:
        """Wait for the optimizer; that ends the trainer's start-up: the garbage collector
        comes back on (settle_heap)."""
        task, self.building = self.building, None
        if task is not None:
            await task
            settle_heap()

    def state_bytes(self) -> bytes:
        """The weights as one ``torch.save`` blob (blocking; the publication before weight
        transports)."""
        return self.policy.state_bytes()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The weights as published (blocking, on the worker): a CPU copy of every tensor in
        :func:`publish_dtype` (floating ones only), contiguous. A copy, because the next
        step updates the policy in place while the copy is chunked and written."""
        dtype = publish_dtype(self.cfg)
        out: dict[str, torch.Tensor] = {}
        # Tied weights (one tensor under two names) stay one object: published once.
        seen: dict[tuple[Any, ...], torch.Tensor] = {}
        for name, t in self.policy.weights().items():
            same = (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
                    t.device)
            if t.numel() and same in seen:
                out[name] = seen[same]
                continue
            want = dtype if dtype is not None and t.is_floating_point() else t.dtype
            out[name] = seen[same] = t.detach().to(device="cpu", dtype=want,
                                                   copy=True).contiguous()
        return out

    def update(self, groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
        """One whole step's update on ``groups`` (a resume's replay; blocking)."""
        return grpo_update(self.policy, self.optimizer, groups, self.cfg.trainer,
                           temperature=self.cfg.rollout.temperature, version=self.version,
                           device=self.device, reference=self.reference,
                           scheduler=self.scheduler)

    def step(self) -> GrpoStep:
        """A step trained as its mini-batches arrive (trainer.update.GrpoStep)."""
        return GrpoStep(self.policy, self.optimizer, self.cfg.trainer,
                        temperature=self.cfg.rollout.temperature, version=self.version,
                        device=self.device, reference=self.reference,
                        scheduler=self.scheduler)
