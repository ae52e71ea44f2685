"""Where a run's files go, derived from its config alone (every component agrees).

``trainer.default_local_dir`` (verl's key) is the checkpoint folder of one run, as in verl:
a fixed folder that a launch line names, so that the same line finds its run again
(``trainer.resume_mode=auto``, :data:`RUN_MARKER`). Null keeps rlbus's layout,
``run.output_dir/RUN/checkpoints``.
"""

from __future__ import annotations

from pathlib import Path

from runconfig.schema import Config

__all__ = ["RUN_MARKER", "checkpoint_dir"]

RUN_MARKER = "rlbus_run.json"
"""The file in ``trainer.default_local_dir`` naming the run whose checkpoints it holds."""


def checkpoint_dir(cfg: Config, run_id: str) -> Path:
    """The checkpoint folder of run ``run_id``: ``trainer.default_local_dir`` when set, else
    ``run.output_dir/RUN/checkpoints``."""
    if cfg.trainer.default_local_dir:
        return Path(cfg.trainer.default_local_dir).expanduser()
    return Path(cfg.run.output_dir) / run_id / "checkpoints"
