"""The trainer component: consumes samples, updates the policy, publishes steps and weights.

:func:`main` is ``rlbus trainer`` and ``python -m trainer``. The process starts with the
garbage collector off (see :func:`runtime.settle_heap`) and imports torch only after its
config is valid.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def _component() -> type:
    from trainer.app import Trainer

    return Trainer


def main(argv: Sequence[str] | None = None) -> int:
    """``rlbus trainer [--config FILE] [KEY=VALUE ...]``; returns the exit code."""
    from runtime import main as run_main

    return run_main("trainer", _component, argv, heavy=True)
