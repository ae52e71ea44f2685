"""Tasks: where prompts come from and how responses are scored.

A prompt source hands out :class:`Prompt` records deterministically: the same seed (or
files) gives the same prompt for the same index, so a restarted trainer re-issues exactly
what it issued before. The built-in tasks (``task.*``) give text prompts and answers; the
rollouter encodes such a prompt with ``tokenizer.encode(prompt, bos=True)``. verl-format data
(``data.train_files``, :mod:`tasks.verl_data`) give each prompt's token ids as well (chat
template applied, truncated), with its ``data_source``, ground truth and ``extra_info``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = ["Prompt", "PromptSource", "build_prompt_source"]


class Prompt(NamedTuple):
    prompt_id: str  # "p{index}", unique within a run
    prompt: str
    answer: str
    prompt_ids: list[int] | None = None  # verl data: token ids to generate from (else encode)
    data_source: str = ""  # verl data: the record's data_source
    ground_truth: Any = None  # verl data: reward_model.ground_truth as stored
    extra_info: dict[str, Any] | None = None  # verl data: the record's extra_info
    agent_name: str = "single_turn_agent"  # verl data: the record's agent loop


@runtime_checkable
class PromptSource(Protocol):
    index: int  # index of the prompt `next()` returns; assign to resume

    def get(self, index: int) -> Prompt: ...

    def next(self) -> Prompt: ...


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _is_run_config(cfg: Any) -> bool:
    """A whole run config (``runconfig.Config``), not a task section or mapping."""
    return not isinstance(cfg, Mapping) and hasattr(cfg, "task") and hasattr(cfg, "data")


def build_prompt_source(cfg: Any = None, seed: int = 0, *,
                        tokenizer: Any = None) -> PromptSource:
    """The prompts of a run.

    ``cfg`` is a whole ``runconfig.Config`` or a task mapping/struct. With a Config whose
    ``data.train_files`` is set: the verl records of those files (:class:`tasks.verl_data.
    VerlPrompts`; ``tokenizer`` renders them, built from ``model.*`` when None). Otherwise
    the task: kind 'digits' (default; min_digits, max_digits) or 'jsonl' (path). ``seed`` is
    used unless the config has its own ``seed``."""
    if _is_run_config(cfg):
        if cfg.data.train_files is not None:
            from tasks.verl_data import train_prompts

            return train_prompts(cfg, tokenizer)
        t = cfg.task
        cfg = {"kind": t.kind, "path": t.path, "min_digits": t.min_digits,
               "max_digits": t.max_digits, "seed": t.seed}
    return _task_source({} if cfg is None else cfg, seed)


def _task_source(cfg: Any, seed: int) -> PromptSource:
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
