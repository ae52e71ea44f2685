"""The trainer's model: the policy, its optimizer and the weights version they hold.

Every method that touches torch is blocking: the trainer calls them on its worker thread
(:meth:`runtime.Component.off`), so its event loop stays free for the lease and the pulse, and
torch.profiler sees every profiled call on the thread it was started on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import torch

from bus.messages import Sample
from policy import build_policy, resolve_device
from runconfig import Config
from runtime import settle_heap
from trainer.update import GrpoStep, grpo_update

__all__ = ["Learner"]


def _vocab_size(policy: torch.nn.Module) -> int | None:
    sizes = [m.num_embeddings for m in policy.modules() if isinstance(m, torch.nn.Embedding)]
    return max(sizes) if sizes else None


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

    def build(self) -> None:
        """The policy (blocking)."""
        tc = self.cfg.trainer
        torch.set_num_threads(tc.threads)
        torch.manual_seed(tc.seed)
        self.policy = build_policy(msgspec.to_builtins(self.cfg.model), self.device)
        self.policy.train()
        self.vocab_size = _vocab_size(self.policy)

    def build_optimizer(self) -> None:
        """Start building the optimizer on a thread of its own: the first torch optimizer of a
        process imports torch._dynamo (about a second), while the worker serialises weights
        version 0. :meth:`optimizer_ready` waits for it."""
        def build() -> None:
            self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.cfg.trainer.lr)

        self.building = asyncio.ensure_future(asyncio.to_thread(build))

    async def optimizer_ready(self) -> None:
        """Wait for the optimizer; that ends the trainer's start-up: the garbage collector
        comes back on (settle_heap)."""
        task, self.building = self.building, None
        if task is not None:
            await task
            settle_heap()

    def state_bytes(self) -> bytes:
        """The weights as published (blocking)."""
        return self.policy.state_bytes()

    def update(self, groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
        """One whole step's update on ``groups`` (a resume's replay; blocking)."""
        return grpo_update(self.policy, self.optimizer, groups, self.cfg.trainer,
                           temperature=self.cfg.rollout.temperature, version=self.version,
                           device=self.device)

    def step(self) -> GrpoStep:
        """A step trained as its mini-batches arrive (trainer.update.GrpoStep)."""
        return GrpoStep(self.policy, self.optimizer, self.cfg.trainer,
                        temperature=self.cfg.rollout.temperature, version=self.version,
                        device=self.device)
