"""The rollouter component: claims prompt tickets, generates with the weights it holds,
publishes samples.

:func:`main` is ``rlbus rollouter`` and ``python -m rollouter``. The process starts with the
garbage collector off (see :func:`runtime.settle_heap`) and imports torch only after its
config is valid.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def _component() -> type:
    from rollouter.app import Rollouter

    return Rollouter


def main(argv: Sequence[str] | None = None) -> int:
    """``rlbus rollouter [--config FILE] [KEY=VALUE ...]``; returns the exit code."""
    from runtime import main as run_main

    return run_main("rollouter", _component, argv, heavy=True)
