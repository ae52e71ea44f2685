"""Reward functions: `(response_text, answer) -> float`, by import path."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from tasks.digits import digits_reward

__all__ = ["RewardFn", "RewardFnError", "load_reward_fn"]

RewardFn = Callable[[str, str], float]


class RewardFnError(ValueError):
    """The reward function path could not be resolved to a callable."""


def load_reward_fn(spec: str | None = None) -> RewardFn:
    """'package.module:function' or 'package.module.function'; None, '' or 'digits' gives
    the digits reward."""
    if spec is None or spec.strip() in ("", "digits"):
        return digits_reward
    spec = spec.strip()
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    else:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise RewardFnError(
            f"reward function {spec!r}: expected 'module:function' or 'module.function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardFnError(f"reward function {spec!r}: cannot import {module_name!r}: {e}") from e
    fn = module
    for part in attr.split("."):
        try:
            fn = getattr(fn, part)
        except AttributeError:
            raise RewardFnError(
                f"reward function {spec!r}: {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(fn):
        raise RewardFnError(f"reward function {spec!r}: {attr!r} is not callable")
    return fn
