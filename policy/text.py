"""Text <-> token ids for the rollouter: the char tokenizer, or a local Hugging Face tokenizer.

The rollouter only needs ``encode(text, bos=True)``, ``decode(ids)`` and ``eos_id``; the
trainer never sees text (samples carry token ids).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from policy.tokenizer import CharTokenizer

__all__ = ["HFTokenizer", "TextTokenizer", "build_tokenizer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class TextTokenizer(Protocol):
    eos_id: int | None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class HFTokenizer:
    """A `transformers` tokenizer from a local directory behind the CharTokenizer interface."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.eos_id: int | None = self._tok.eos_token_id
        self.bos_id: int | None = self._tok.bos_token_id

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False))
        if bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids or [self.eos_id or 0]  # generation needs at least one prompt token

    def decode(self, ids: Iterable[int]) -> str:
        out = []
        for i in ids:
            if self.eos_id is not None and int(i) == self.eos_id:
                break
            out.append(int(i))
        return self._tok.decode(out, skip_special_tokens=True)


def _get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key, None)


def build_tokenizer(model_cfg: Any) -> TextTokenizer:
    """The tokenizer that goes with ``model_cfg``: for ``kind: hf``, the tokenizer saved in
    ``model.path`` when there is one; otherwise the char tokenizer of the built-in tasks."""
    path = _get(model_cfg, "path")
    if _get(model_cfg, "kind") == "hf" and path:
        if any((Path(path) / name).exists() for name in _TOKENIZER_FILES):
            return HFTokenizer(path)
    return CharTokenizer()
