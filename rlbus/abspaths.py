"""Paths of a config made absolute against the directory ``rlbus up`` was called from.

Why: under ``run.launcher=ray`` each component runs where Ray started its worker (the
directory of ``ray start``, or a Ray temp dir), not where the user typed ``rlbus up``; a
relative ``run.output_dir`` or data file would then name another place (the logger exited 2
on a relative output_dir). The launcher resolves every path key once, before submission.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from runconfig import Config

__all__ = ["PATH_KEYS", "absolute_paths"]

PATH_KEYS: tuple[str, ...] = (
    "run.output_dir",
    "model.path",
    "task.path",
    "data.train_files",
    "data.val_files",
    "custom_reward_function.path",
    "data.custom_cls.path",
    "rollout.multi_turn.tool_config_path",
    "rollout.multi_turn.function_tool_path",
    "trainer.default_local_dir",
    "trainer.rollout_data_dir",
    "trainer.validation_data_dir",
    "global_profiler.save_path",
    "redis.binary",
    "run.storage",
)
"""Config keys whose values are local paths (a string, or a list of them for data files).
``redis.binary`` counts only when it names a file (has a ``/``): a bare name is looked up
on PATH. A URL (``s3://…``, ``file://…``, what ``run.storage`` may be) is kept as it is."""


def _absolute(value: str, cwd: Path, key: str) -> str:
    if key == "redis.binary" and os.sep not in value:
        return value
    if "://" in value:  # an fsspec URL names its own place; only plain paths depend on cwd
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else cwd / path)


def _resolved(value: Any, cwd: Path, key: str) -> Any:
    if isinstance(value, str):
        return _absolute(value, cwd, key)
    if isinstance(value, list):
        return [_absolute(v, cwd, key) if isinstance(v, str) else v for v in value]
    return value


def absolute_paths(cfg: Config, cwd: Path) -> Config:
    """``cfg`` with every :data:`PATH_KEYS` value absolute (``~`` expanded, relative ones
    joined to ``cwd``); nulls and absolute paths unchanged. Pure: reads no file."""
    for key in PATH_KEYS:
        cfg = _replaced(cfg, key.split("."), cwd, key)
    return cfg


def _replaced(section: Any, path: list[str], cwd: Path, key: str) -> Any:
    """``section`` with the value at ``path`` (its fields, nested) made absolute."""
    value = getattr(section, path[0])
    new = _resolved(value, cwd, key) if len(path) == 1 else _replaced(value, path[1:], cwd, key)
    return section if new == value else msgspec.structs.replace(section, **{path[0]: new})
