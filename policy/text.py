"""Text <-> token ids for the rollouter: the char tokenizer, or a local Hugging Face tokenizer.

The rollouter only needs ``encode(text, bos=True)``, ``decode(ids)`` and ``eos_id``; the
trainer never sees text (samples carry token ids) except to render verl data's prompts
(``HFTokenizer.hf``, the transformers tokenizer with its chat template).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from policy.tokenizer import CharTokenizer

__all__ = ["HFTokenizer", "TextTokenizer", "build_tokenizer", "decode_conversation"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class TextTokenizer(Protocol):
    """What the tasks and the rollouter ask of a tokenizer: :class:`HFTokenizer`, or the
    built-in tasks' :class:`~policy.tokenizer.CharTokenizer`."""

    @property
    def eos_id(self) -> int | None: ...

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class HFTokenizer:
    """A `transformers` tokenizer from a local directory behind the CharTokenizer interface.

    ``eos_ids``: every id that ends a response, the tokenizer's EOS first, then those the
    directory's ``generation_config.json`` lists (a chat model often ends a turn with one
    token and a document with another); ``eos_id`` is the first of them."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.eos_ids: list[int] = _eos_ids(self.hf.eos_token_id, Path(path))
        self.eos_id: int | None = self.eos_ids[0] if self.eos_ids else None
        self.bos_id: int | None = self.hf.bos_token_id

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids or [self.eos_id or 0]  # generation needs at least one prompt token

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` up to the first of any EOS id."""
        stop = set(self.eos_ids)
        out = []
        for i in ids:
            if int(i) in stop:
                break
            out.append(int(i))
        return self.hf.decode(out, skip_special_tokens=True)


def decode_conversation(tokenizer: TextTokenizer, ids: Iterable[int]) -> str:
    """The text of a conversation's response (rollout.multi_turn): every token, its turns'
    end tokens stopping nothing, special tokens skipped, as verl's reward managers decode a
    response; a tokenizer without a Hugging Face one decodes as it does."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return tokenizer.decode(ids)
    return str(hf.decode([int(i) for i in ids], skip_special_tokens=True))


def _eos_ids(tokenizer_eos: int | None, path: Path) -> list[int]:
    """The tokenizer's EOS id, then generation_config.json's ``eos_token_id`` (an int or a
    list), without repeats."""
    ids: list[int] = [] if tokenizer_eos is None else [int(tokenizer_eos)]
    try:
        listed = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        listed = None
    for i in listed if isinstance(listed, list) else [listed]:
        if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
            ids.append(i)
    return ids


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
