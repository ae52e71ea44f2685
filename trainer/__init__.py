"""The trainer component: consumes samples, updates the policy, publishes steps and weights.

:func:`main` is ``rlbus trainer`` and ``python -m trainer``. The process starts with the
garbage collector off (see :func:`runtime.settle_heap`) and imports torch only after its
config is valid.
"""

from runtime.process import entry_point

__all__ = ["main"]

main = entry_point("trainer", "trainer.app", "Trainer", heavy=True)
"""``rlbus trainer [--config FILE] [KEY=VALUE ...]``; returns the exit code."""
