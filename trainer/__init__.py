"""The trainer component: consumes samples, updates the policy, publishes steps and weights.

:func:`main` is ``rlbus trainer`` and ``python -m trainer``. The process starts with the
garbage collector off (see :func:`runtime.settle_heap`) and imports torch only after its
config is valid. With verl data (``data.train_files`` / ``val_files``) the precheck loads and
checks them (the model's tokenizer renders the prompts) before Redis is contacted.
"""

import sys

from runconfig import Config, ConfigError
from runtime.process import entry_point

__all__ = ["main"]


def _precheck(cfg: Config, prog: str) -> int | None:
    """Before Redis: load and check the run's verl data (exit 2 naming the key, the file and
    the column); the trainer then draws its prompts from what this loaded."""
    if cfg.data.train_files is None and cfg.data.val_files is None:
        return None
    from tasks.verl_data import check_data

    try:
        check_data(cfg)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return None


def _other_node(cfg: Config) -> int | None:
    """``trainer.node_rank`` > 0: this node runs trainer ranks only (trainer.rank), no
    component: rank 0's node talks to Redis."""
    if cfg.trainer.node_rank == 0:
        return None
    from trainer.rank import run_node

    return run_node(cfg)


main = entry_point("trainer", "trainer.app", "Trainer", heavy=True, precheck=_precheck,
                   divert=_other_node)
"""``rlbus trainer [--config FILE] [KEY=VALUE ...]``; returns the exit code."""
