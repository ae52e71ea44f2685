"""Tasks: where prompts come from and how responses are scored.

A prompt source hands out `Prompt(prompt_id, prompt, answer)` triples deterministically:
the same seed (or file) gives the same prompt for the same index, so a restarted trainer
re-issues exactly what it issued before. Prompts and answers are text; the rollouter encodes
a prompt with `CharTokenizer.encode(prompt, bos=True)` for the tiny policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = ["Prompt", "PromptSource", "build_prompt_source"]


class Prompt(NamedTuple):
    prompt_id: str  # "p{index}", unique within a run
    prompt: str
    answer: str


@runtime_checkable
class PromptSource(Protocol):
    index: int  # index of the prompt `next()` returns; assign to resume

    def get(self, index: int) -> Prompt: ...

    def next(self) -> Prompt: ...


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def build_prompt_source(cfg: Any = None, seed: int = 0) -> PromptSource:
    """From a mapping or struct: kind 'digits' (default; min_digits, max_digits) or 'jsonl'
    (path). `seed` is used unless the config has its own `seed`."""
    cfg = {} if cfg is None else cfg
    kind = _get(cfg, "kind", "digits") or "digits"
    s = _get(cfg, "seed", None)
    seed = seed if s is None else int(s)
    if kind == "digits":
        from tasks.digits import DigitsPrompts

        return DigitsPrompts(
            seed=seed,
            min_digits=int(_get(cfg, "min_digits", None) or 4),
            max_digits=int(_get(cfg, "max_digits", None) or 4),
        )
    if kind == "jsonl":
        from tasks.jsonl import JsonlPrompts

        path = _get(cfg, "path", None)
        if not path:
            raise ValueError("task kind 'jsonl' needs a path")
        return JsonlPrompts(path, seed=_get(cfg, "shuffle_seed", None))
    raise ValueError(f"unknown task kind {kind!r} (expected 'digits' or 'jsonl')")
