"""Rules every reader of a run's log applies to the facts it folds (pure, no Redis).

A reader refuses a fact that contradicts the log it has read, whoever wrote it: the run's
Redis ACLs keep other writers off the trainer's facts, and readers never fold them when they
get in anyway. These are the rules shared by several readers; the trainer's own fold has
more (trainer.state). :func:`step_reward` reads a step's reward in logs of every build,
before and after the trainer kept only verl's name for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher imports this module: no msgspec structs (numpy) at its start
    from runschema.messages import RunFinished

__all__ = ["STEP_REWARD", "run_finished_refusal", "step_reward", "validation_only_refusal"]

STEP_REWARD = "critic/score/mean"
"""The StepFinished metric that is the step's mean reward: verl's name, over every sample
the step trained (verl leaves empty responses out; the trainer refuses them)."""


def run_finished_refusal(finished: RunFinished, last_step: int) -> str | None:
    """Why ``finished`` read after the StepFinished of ``last_step`` (0: none) is not
    believed, or None. The trainer writes it after the StepFinished of its last step, saying
    that step: any other count contradicts the log. A run finishes after at least one step,
    unless it only validated (``trainer.val_only``: its steps are those it started from)."""
    steps = finished.steps
    if steps < 1 and not finished.validation_only:
        return f"RunFinished(steps={steps}): a run finishes after at least one step"
    if steps != last_step:
        return (f"RunFinished(steps={steps}) contradicts the log: its last StepFinished is of "
                f"step {last_step}")
    return None


def validation_only_refusal(run_id: str, last_step: int, forked_at: int | None) -> str | None:
    """Why ``trainer.val_only`` may not run on run ``run_id`` whose log's last StepFinished
    is of ``last_step`` (``forked_at``: the step its RunForked names, None without one), or
    None. A validation-only run finishes once its answer is in; on a run with steps it
    trained itself that would end its training. A fresh run validates the initial model; a
    fork with no step after its fork point validates the parent's model after that step."""
    if last_step in (0, forked_at):
        return None
    return (f"trainer.val_only=True: run {run_id} has trained {last_step} steps and validating "
            f"it here would finish it; validate a fork instead: rlbus fork --run {run_id} "
            f"--at {last_step} --new-run NEW trainer.val_only=True")


def step_reward(metrics: Mapping[str, float]) -> float:
    """The step's mean reward in a StepFinished's ``metrics``: :data:`STEP_REWARD`, else
    ``reward/mean``, the same figure under the trainer's own name in logs written before it
    kept only verl's; NaN in a step with neither."""
    reward = metrics.get(STEP_REWARD, metrics.get("reward/mean"))
    return math.nan if reward is None else reward
