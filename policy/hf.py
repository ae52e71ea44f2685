"""HFPolicy: a Hugging Face causal LM behind the policy boundary, loaded from a local directory.

Generation uses our own sampling loop (`policy.decode_loop`) rather than `model.generate`, so
rollout log-probs are computed exactly as `logprobs_and_entropy` recomputes them.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from policy import (
    EosIds,
    Generation,
    decode_loop,
    eos_set,
    logprobs_from_logits,
    make_generator,
    positions_from_mask,
    resolve_device,
)
from policy.weights import from_bytes, to_bytes

if TYPE_CHECKING:  # transformers is imported when a model is loaded, not before
    from transformers import PreTrainedModel

__all__ = ["HFPolicy", "apply_override_config"]

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


def apply_override_config(config: Any, override: Mapping[str, Any]) -> None:
    """Set ``override``'s keys on a transformers config, as verl's ``override_config`` does:
    a nested mapping updates the sub-config of that name (``text_config: {...}``), and a
    ``model_config`` mapping (verl's Megatron spelling) stands for the whole override."""
    if isinstance(override.get("model_config"), Mapping):
        override = override["model_config"]
    for key, value in override.items():
        if key == "attn_implementation":
            continue  # a loading option (from_pretrained's argument), not a config value
        if isinstance(value, Mapping) and getattr(config, key, None) is not None:
            apply_override_config(getattr(config, key), value)
        else:
            setattr(config, key, value)


class HFPolicy(nn.Module):
    """Wraps a `transformers` causal LM (anything `AutoModelForCausalLM` loads).

    ``autocast``: run forward passes in this dtype under torch.autocast (the trainer's bf16:
    float32 weights, bf16 compute); log-probs are always taken in float32."""

    def __init__(self, model: PreTrainedModel, eos_id: int | None = None,
                 pad_id: int | None = None,
                 *, autocast: torch.dtype | None = None) -> None:
        super().__init__()
        self.model = model
        cfg = getattr(model, "config", None)
        gen = getattr(model, "generation_config", None)
        cfg_eos = getattr(cfg, "eos_token_id", None)
        gen_eos = getattr(gen, "eos_token_id", None)
        if eos_id is None:
            eos_id = _first_id(cfg_eos)
        self.eos_id: int | None = eos_id if eos_id is not None else _first_id(gen_eos)
        # Every id the model's generation_config lists ends a response, as in vLLM and
        # model.generate (Qwen's list both <|im_end|> and <|endoftext|>).
        self.eos_ids: tuple[int, ...] = eos_set(self.eos_id, gen_eos, cfg_eos)
        pad = pad_id if pad_id is not None else _first_id(getattr(cfg, "pad_token_id", None))
        # Pads are masked out, so any valid id works; eos is the usual stand-in.
        self.pad_id: int = pad if pad is not None else (self.eos_id or 0)
        # transformers 5.x renamed `past_key_values` to `cache` (the old name warns).
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.autocast = autocast
        self.gradient_checkpointing = False

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each decoder layer's activations in the backward pass (verl's
        ``enable_gradient_checkpointing``): less memory for one more forward per layer."""
        enable = getattr(self.model, "activation_checkpointing_enable", None)
        if enable is None:  # transformers < 5
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.gradient_checkpointing = True
        self.train(self.training)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype | None = None,
        *,
        training: bool = False,
        override_config: Mapping[str, Any] | None = None,
        gradient_checkpointing: bool = False,
    ) -> HFPolicy:
        """Load from a local directory written by `save_pretrained`; never from the hub.

        ``override_config`` is applied to the model's config before the weights load
        (:func:`apply_override_config`). With ``training``, a bf16 ``dtype`` keeps float32
        weights and computes in bf16 autocast (an optimizer needs float32 weights: an update
        of lr 1e-6 is lost in bf16's 8-bit mantissa); otherwise the weights load in
        ``dtype``. ``gradient_checkpointing`` applies to training only."""
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} is not a local model directory (no config.json); "
                "models are never downloaded"
            )
        kwargs: dict[str, Any] = {"local_files_only": True}
        override = dict(override_config or {})
        if override:
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
            apply_override_config(config, override)
            kwargs["config"] = config
        if "attn_implementation" in override:
            kwargs["attn_implementation"] = override["attn_implementation"]
        want = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        autocast = None
        if training and want in (torch.bfloat16, torch.float16):
            want, autocast = torch.float32, want
        if want is not None:
            kwargs["dtype"] = want
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        policy = cls(model, autocast=autocast).to(resolve_device(device))
        if gradient_checkpointing and training:
            policy.enable_gradient_checkpointing()
        return policy

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def train(self, mode: bool = True) -> HFPolicy:
        # The wrapped model stays in eval mode: with dropout on, the trainer's log-probs
        # would not match the rollout's (gradients flow either way).
        super().train(mode)
        self.model.eval()
        if mode and self.gradient_checkpointing:
            # transformers checkpoints a layer only when that layer is in training mode: set
            # the flag on the checkpointed layers alone, so their dropouts (and attention
            # dropout, which reads its own module's flag) stay off.
            for layer in self._checkpointed_layers():
                layer.training = True
        return self

    def _checkpointed_layers(self) -> Iterator[nn.Module]:
        layer_type: type[nn.Module]
        try:
            from transformers.modeling_layers import GradientCheckpointingLayer

            layer_type = GradientCheckpointingLayer
        except ImportError:  # transformers < 4.53: every module with the flag
            layer_type = nn.Module
        for m in self.model.modules():
            if isinstance(m, layer_type) and getattr(m, "gradient_checkpointing",
                                                                     False) is True:
                yield m

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, cache: Any, use_cache: bool
    ) -> tuple[torch.Tensor, Any]:
        pos = positions_from_mask(mask)[:, -ids.shape[1]:]
        kwargs = {self._cache_kw: cache} if cache is not None else {}
        amp = (torch.autocast(ids.device.type, dtype=self.autocast) if self.autocast is not None
               else contextlib.nullcontext())
        with amp:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                             use_cache=use_cache, **kwargs)
        return out.logits, getattr(out, self._cache_kw, None) if use_cache else None

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        eos_id: EosIds = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        *,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> Generation:
        was_training = self.training
        self.eval()
        try:
            return decode_loop(
                lambda ids, mask, cache: self._forward(ids, mask, cache, use_cache=True),
                prompts,
                max_new_tokens,
                temperature,
                self.eos_ids if eos_id is None else eos_id,
                self.pad_id,
                self.device,
                generator or make_generator(seed, self.device),
                top_p=top_p,
                top_k=top_k,
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

    def weights(self, keep_vars: bool = False) -> Mapping[str, torch.Tensor]:
        """The tensors as published (the names :meth:`load_state` takes); ``keep_vars``:
        the parameters themselves, so tied ones are one object under two names."""
        return self.model.state_dict(keep_vars=keep_vars)

    def load_bytes(self, blob: bytes) -> None:
        self.load_state(from_bytes(blob))

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
