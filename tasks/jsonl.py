"""Prompts from a JSON-lines file of {"prompt": str, "answer": str} objects."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tasks import Prompt

__all__ = ["JsonlPrompts", "load_jsonl"]


def load_jsonl(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, answer) pairs; blank lines are skipped, anything else malformed is an error
    naming the file and line."""
    pairs: list[tuple[str, str]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
            if not isinstance(obj, dict) or not all(
                isinstance(obj.get(k), str) for k in ("prompt", "answer")
            ):
                raise ValueError(f'{path}:{lineno}: expected {{"prompt": str, "answer": str}}')
            pairs.append((obj["prompt"], obj["answer"]))
    if not pairs:
        raise ValueError(f"{path}: no prompts")
    return pairs


class JsonlPrompts:
    """Cycles through the file's prompts; ids are `p{index}` over all epochs, so they stay
    unique. With `seed`, each epoch visits the prompts in its own deterministic order."""

    def __init__(self, path: str | Path, seed: int | None = None) -> None:
        self.path = Path(path)
        self.pairs = load_jsonl(self.path)
        self.seed = seed
        self.index = 0

    def __len__(self) -> int:
        return len(self.pairs)

    def get(self, index: int) -> Prompt:
        epoch, i = divmod(index, len(self.pairs))
        if self.seed is not None:
            order = list(range(len(self.pairs)))
            random.Random(f"jsonl/{self.seed}/{epoch}").shuffle(order)
            i = order[i]
        prompt, answer = self.pairs[i]
        return Prompt(f"p{index}", prompt, answer)

    def next(self) -> Prompt:
        p = self.get(self.index)
        self.index += 1
        return p
