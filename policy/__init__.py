"""The policy boundary: what the trainer and the rollouter may ask of a language model.

Two implementations: `policy.model.TinyGPT` (a small transformer for the built-in tasks) and
`policy.hf.HFPolicy` (any Hugging Face causal LM from a local directory). Both are
`torch.nn.Module`s, so `parameters()`, `to()`, `train()` and `eval()` come from torch.

Batch layout shared by generation and training: each row is a prompt left-padded to a common
width followed by its response right-padded to a common width, with an attention mask marking
real tokens (`trainer.grpo.build_batch` makes it). Implementations derive position ids from
the mask, so padding never shifts a token's position and the rollout log-probs match the
trainer's recomputation on the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self, TypeVar, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "EosIds",
    "Generation",
    "Policy",
    "StepFn",
    "build_policy",
    "decode_loop",
    "decode_steps",
    "eos_set",
    "filter_logits",
    "left_pad",
    "logprobs_from_logits",
    "make_generator",
    "positions_from_mask",
    "resolve_device",
]

EosIds = int | Sequence[int] | None
"""One end-of-sequence id, several (a generation_config often lists more than one), or none."""


@dataclass
class Generation:
    """Result of `Policy.generate`, one entry per prompt, in prompt order."""

    tokens: list[list[int]]  # response token ids; ends with an eos id when one was sampled
    # float32: log-prob of each response token under softmax(logits / temperature) of the
    # whole vocabulary, whatever top_k / top_p drew it from (see decode_loop)
    logprobs: list[np.ndarray]
    finished: list[bool]  # True when an eos id ended the response, False when max_new_tokens did


@runtime_checkable
class Policy(Protocol):
    """What components use. Implementations are `torch.nn.Module`s."""

    pad_id: int
    eos_id: int | None
    eos_ids: tuple[int, ...]
    """Every id that ends a response by default (``eos_id`` first)."""

    @property
    def device(self) -> torch.device: ...

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
        """Sample one response per prompt. temperature <= 0 means greedy. ``eos_id``: the
        ids that end a response (None: ``eos_ids``). top_k <= 0 and top_p >= 1 are off."""
        ...

    def logprobs_and_entropy(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_len: int,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable log-probs and entropies [B, response_len] of the last
        `response_len` columns of `input_ids` [B, T], each given the columns before it."""
        ...

    def state_bytes(self) -> bytes: ...

    def weights(self, keep_vars: bool = False) -> Mapping[str, torch.Tensor]:
        """The tensors as published, named as :meth:`load_state` takes them; ``keep_vars``:
        the parameters themselves (tied ones one object), as ``state_dict(keep_vars=True)``."""
        ...

    def load_bytes(self, blob: bytes) -> None: ...

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy a decoded state dict (``policy.weights.from_bytes``) into the weights."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def to(self, *args: Any, **kwargs: Any) -> Self: ...

    def train(self, mode: bool = True) -> Self: ...

    def eval(self) -> Self: ...


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' means CUDA when present, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def left_pad(
    seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to one width: (ids [B, W] long, mask [B, W] long)."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = torch.as_tensor(np.asarray(s, dtype=np.int64))
            mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each real token within its own (unpadded) sequence; pads get 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy under softmax(logits / temperature), in float32.

    Rollout and training must both call this with the same temperature, otherwise the
    rollout log-probs are not the old log-probs of the PPO ratio.
    """
    logp_all = F.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), -1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def eos_set(*ids: EosIds) -> tuple[int, ...]:
    """The distinct ids of ``ids`` (each an id, a list of ids or None), in first-seen order."""
    out: list[int] = []
    for x in ids:
        for i in ([] if x is None else [x] if isinstance(x, int) else x):
            if int(i) not in out:
                out.append(int(i))
    return tuple(out)


def filter_logits(logits: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """``logits`` [B, V] with the tokens outside top-k, then outside the nucleus top-p, set to
    -inf (vLLM's order and meaning: top_k <= 0 or >= V is off, top_p >= 1 is off; the most
    likely token always stays). Pass logits already divided by the temperature."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # Drop a token when the tokens more likely than it already hold top_p of the mass:
        # the smallest set reaching top_p stays, and the first token always does.
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _sample(last: torch.Tensor, temperature: float, top_k: int, top_p: float,
            generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``last`` [B, V] (float32 logits): greedy at temperature <= 0."""
    if temperature <= 0:
        return last.argmax(-1)
    scaled = filter_logits(last / temperature, top_k, top_p)
    return torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator).squeeze(-1)


class _Steps:
    count = 0


_STEPS = _Steps()


def decode_steps() -> int:
    """Forward passes :func:`decode_loop` has made in this process (a prefill, then one per
    token): generation's progress, monotonic. The rollouter's heartbeat reports it, so a
    long decode shows as progress and a wedged one as none."""
    return _STEPS.count


Cache = TypeVar("Cache")
"""An implementation's KV cache (TinyGPT: tensors per block; HFPolicy: transformers' cache)."""

# step(new_ids [B, T], full_mask [B, past + T], cache | None) -> (logits [B, T, V], cache)
StepFn = Callable[[torch.Tensor, torch.Tensor, Cache | None], tuple[torch.Tensor, Cache]]


@torch.inference_mode()
def decode_loop(
    step: StepFn[Cache],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
    eos_id: EosIds,
    pad_id: int,
    device: torch.device,
    generator: torch.Generator | None = None,
    *,
    top_p: float = 1.0,
    top_k: int = -1,
) -> Generation:
    """Batched sampling with a KV cache, shared by every Policy implementation.

    A response ends at any id of ``eos_id`` (an id or several). Tokens are drawn from
    softmax(logits / temperature) restricted to top-k / top-p (:func:`filter_logits`); greedy
    when temperature <= 0. The log-prob recorded for each token is that of the *whole*
    distribution softmax(logits / temperature), not of the filtered one: the trainer
    recomputes exactly that (``logprobs_from_logits`` over the full vocabulary) as the PPO
    ratio's new log-prob, so on equal weights the ratio is 1, as it must be. The filtered
    distribution's log-prob would differ by the log of the mass kept (log 1 = 0 when the
    filter is off) and bias every ratio by it."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. bos)")
    if not prompts or max_new_tokens <= 0:
        n = len(prompts)
        return Generation([[] for _ in range(n)], [np.zeros(0, np.float32) for _ in range(n)],
                          [False] * n)
    eos_ids = eos_set(eos_id)
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    ids, mask = left_pad(prompts, pad_id, device)
    logits, cache = step(ids, mask, None)
    _STEPS.count += 1  # only ever grows (a race between two generating threads loses a count)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    toks, logps, alive = [], [], []
    for t in range(max_new_tokens):
        last = logits[:, -1].float()
        tok = _sample(last, temperature, top_k, top_p, generator)
        logp, _ = logprobs_from_logits(last, tok, temperature)
        alive.append(~done)
        toks.append(tok)
        logps.append(logp)
        if eos.numel():
            done = done | torch.isin(tok, eos)
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        # Finished rows keep decoding (their tokens are dropped below): simpler than
        # shrinking the batch and the cache, and cheap at these sizes.
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        logits, cache = step(tok[:, None], mask, cache)
        _STEPS.count += 1
    tok_m = torch.stack(toks, 1).cpu()
    logp_m = torch.stack(logps, 1).cpu().numpy().astype(np.float32)
    lens = torch.stack(alive, 1).sum(1).cpu().tolist()
    tokens = [tok_m[i, :n].tolist() for i, n in enumerate(lens)]
    return Generation(
        tokens=tokens,
        logprobs=[logp_m[i, :n].copy() for i, n in enumerate(lens)],
        finished=[bool(t) and t[-1] in eos_ids for t in tokens],
    )


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def build_policy(cfg: Any = None, device: str | torch.device = "auto", *,
                 training: bool = False) -> Policy:
    """Policy from a config mapping or struct: kind 'tiny' (default) or 'hf' with `path`.

    tiny keys: vocab_size (default: the char tokenizer's), d_model, n_layers, n_heads,
    max_len, dropout, seed (weight init; the global RNG is left untouched).
    hf keys: path (a local directory), dtype (fp32 default, bf16; verl's names),
    override_config (keys set on the model's config before loading),
    enable_gradient_checkpointing. ``training``: the trainer's copy: with dtype bf16 its
    weights stay float32 and its forward passes run in bfloat16 autocast (verl's FSDP mixed
    precision: fp32 master weights, bf16 compute), where the rollouter's copy holds bf16
    weights (verl's rollout dtype).
    """
    cfg = {} if cfg is None else cfg
    kind = _get(cfg, "kind", "tiny") or "tiny"
    dev = resolve_device(device)
    if kind == "tiny":
        from policy.model import TinyConfig, TinyGPT
        from policy.tokenizer import CharTokenizer

        defaults = TinyConfig(vocab_size=CharTokenizer().vocab_size)
        fields = {
            k: getattr(defaults, k) if (v := _get(cfg, k)) is None else v
            for k in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len", "dropout")
        }
        seed = _get(cfg, "seed", 0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0 if seed is None else int(seed))
            model = TinyGPT(TinyConfig(**fields))
        return model.to(dev)
    if kind == "hf":
        from policy.hf import HFPolicy

        path = _get(cfg, "path", None)
        if not path:
            raise ValueError("policy.kind 'hf' needs policy.path (a local model directory)")
        return HFPolicy.from_pretrained(
            path, device=dev, dtype=_get(cfg, "dtype", None), training=training,
            override_config=_get(cfg, "override_config", None),
            gradient_checkpointing=bool(_get(cfg, "enable_gradient_checkpointing", False)),
        )
    raise ValueError(f"unknown policy kind {kind!r} (expected 'tiny' or 'hf')")
