"""The rollouter component: claims prompt tickets, generates with the weights it holds,
publishes samples.

:func:`main` is ``rlbus rollouter`` and ``python -m rollouter``. The process starts with the
garbage collector off (see :func:`runtime.settle_heap`) and imports torch only after its
config is valid.
"""

from runtime.process import entry_point

__all__ = ["main"]

main = entry_point("rollouter", "rollouter.app", "Rollouter", heavy=True)
"""``rlbus rollouter [--config FILE] [KEY=VALUE ...]``; returns the exit code."""
