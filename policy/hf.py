"""HFPolicy: a Hugging Face causal LM behind the policy boundary, loaded from a local directory.

Generation uses our own sampling loop (`policy.decode_loop`) rather than `model.generate`, so
rollout log-probs are computed exactly as `logprobs_and_entropy` recomputes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from policy import (
    Generation,
    decode_loop,
    logprobs_from_logits,
    make_generator,
    positions_from_mask,
    resolve_device,
)
from policy.weights import from_bytes, to_bytes

__all__ = ["HFPolicy"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _first_id(x: int | Sequence[int] | None) -> int | None:
    if isinstance(x, Sequence):
        return int(x[0]) if len(x) else None
    return None if x is None else int(x)


class HFPolicy(nn.Module):
    """Wraps a `transformers` causal LM (anything `AutoModelForCausalLM` loads)."""

    def __init__(self, model: nn.Module, eos_id: int | None = None, pad_id: int | None = None):
        super().__init__()
        self.model = model
        cfg = getattr(model, "config", None)
        self.eos_id: int | None = (
            eos_id if eos_id is not None else _first_id(getattr(cfg, "eos_token_id", None))
        )
        pad = pad_id if pad_id is not None else _first_id(getattr(cfg, "pad_token_id", None))
        # Pads are masked out, so any valid id works; eos is the usual stand-in.
        self.pad_id: int = pad if pad is not None else (self.eos_id or 0)
        # transformers 5.x renamed `past_key_values` to `cache` (the old name warns).
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype | None = None,
    ) -> HFPolicy:
        """Load from a local directory written by `save_pretrained`; never from the hub."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} is not a local model directory (no config.json); "
                "models are never downloaded"
            )
        kwargs: dict[str, Any] = {"local_files_only": True}
        if dtype is not None:
            kwargs["dtype"] = dtype if not isinstance(dtype, str) or dtype == "auto" else (
                _DTYPES[dtype]
            )
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        return cls(model).to(resolve_device(device))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def train(self, mode: bool = True) -> HFPolicy:
        # The wrapped model stays in eval mode: with dropout on, the trainer's log-probs
        # would not match the rollout's (gradients flow either way).
        super().train(mode)
        self.model.eval()
        return self

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, cache: Any, use_cache: bool
    ) -> tuple[torch.Tensor, Any]:
        pos = positions_from_mask(mask)[:, -ids.shape[1]:]
        kwargs = {self._cache_kw: cache} if cache is not None else {}
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=use_cache, **kwargs
        )
        return out.logits, getattr(out, self._cache_kw, None) if use_cache else None

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        eos_id: int | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Generation:
        was_training = self.training
        self.eval()
        try:
            return decode_loop(
                lambda ids, mask, cache: self._forward(ids, mask, cache, use_cache=True),
                prompts,
                max_new_tokens,
                temperature,
                self.eos_id if eos_id is None else eos_id,
                self.pad_id,
                self.device,
                generator or make_generator(seed, self.device),
            )
        finally:
            self.train(was_training)

    def logprobs_and_entropy(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_len: int,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, _ = self._forward(input_ids, attention_mask, None, use_cache=False)
        pred = logits[:, -response_len - 1 : -1]
        return logprobs_from_logits(pred, input_ids[:, -response_len:], temperature)

    def state_bytes(self) -> bytes:
        return to_bytes(self.model.state_dict())

    def load_bytes(self, blob: bytes) -> None:
        self.load_state(from_bytes(blob))

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
