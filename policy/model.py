"""TinyGPT: a small causal transformer (pre-LayerNorm, learned absolute positions, tied
embeddings, KV-cached sampling)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from policy import (
    EosIds,
    Generation,
    decode_loop,
    eos_set,
    logprobs_from_logits,
    make_generator,
    positions_from_mask,
)
from policy.tokenizer import CharTokenizer
from policy.weights import from_bytes, to_bytes

__all__ = ["TinyConfig", "TinyGPT"]

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [B, H, S, hd]


@dataclass
class TinyConfig:
    vocab_size: int = CharTokenizer().vocab_size
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 32  # prompt + response tokens
    dropout: float = 0.0


class SelfAttention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
            for t in self.qkv(x).split(C, dim=2)
        )
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(B, T, C)), (k, v)


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        a, cache = self.attn(self.ln1(x), mask, cache)
        x = x + a
        return x + self.mlp(self.ln2(x)), cache


class TinyGPT(nn.Module):
    """The default policy. Implements `policy.Policy`."""

    def __init__(self, cfg: TinyConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or TinyConfig()
        tok = CharTokenizer()
        self.pad_id: int = tok.pad_id
        self.eos_id: int | None = tok.eos_id
        self.eos_ids: tuple[int, ...] = eos_set(tok.eos_id)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: fewer parameters, learns faster
        self.apply(self._init)
        # GPT-2 trick: shrink residual projections so the stack starts close to identity.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        # Small weights give near-uniform logits at init, so early samples explore.
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.cfg)

    def forward(
        self,
        idx: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """Logits [B, T, V] for new tokens `idx` [B, T].

        `attention_mask` [B, past + T] covers the cached tokens and the new ones (1 = real).
        """
        B, T = idx.shape
        past = 0 if cache is None else cache[0][0].shape[2]
        if attention_mask is None:
            attention_mask = torch.ones(B, past + T, dtype=torch.long, device=idx.device)
        S = attention_mask.shape[1]
        if S != past + T:
            raise ValueError(f"attention_mask covers {S} tokens, expected {past + T}")
        if S > self.cfg.max_len:
            raise ValueError(f"sequence length {S} exceeds max_len {self.cfg.max_len}")
        # Positions from the mask: padding never shifts a token, and a sequence continued
        # from "prompt + tokens so far" (partial rollout) sees the same positions again.
        pos = positions_from_mask(attention_mask)[:, past:]
        # Query i (absolute column past + i) sees real keys j <= past + i. Every query also
        # sees itself, so rows of pad queries are never fully masked (no NaN).
        cols = torch.arange(S, device=idx.device)
        rows = cols[past:, None]
        mask = (cols[None, :] <= rows) & attention_mask.bool()[:, None, None, :]
        mask = mask | (cols[None, :] == rows)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        new_cache: KVCache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, mask, None if cache is None else cache[i])
            new_cache.append(kv)
        return self.head(self.ln_f(x)), new_cache

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
        longest = max((len(p) for p in prompts), default=0)
        if longest + max_new_tokens > self.cfg.max_len:
            raise ValueError(
                f"prompt length {longest} + max_new_tokens {max_new_tokens} exceeds "
                f"max_len {self.cfg.max_len}"
            )
        was_training = self.training
        self.eval()
        try:
            return decode_loop(
                lambda ids, mask, cache: self(ids, mask, cache),
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
        logits, _ = self(input_ids, attention_mask)
        # Column t's logits predict column t + 1.
        pred = logits[:, -response_len - 1 : -1]
        return logprobs_from_logits(pred, input_ids[:, -response_len:], temperature)

    def state_bytes(self) -> bytes:
        return to_bytes(self.state_dict())

    def weights(self, keep_vars: bool = False) -> Mapping[str, torch.Tensor]:
        """The tensors as published (the names :meth:`load_state` takes); ``keep_vars``:
        the parameters themselves, so tied ones are one object under two names."""
        return self.state_dict(keep_vars=keep_vars)

    def load_bytes(self, blob: bytes) -> None:
        self.load_state(from_bytes(blob))

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.load_state_dict(state)
