"""Rules every reader of a run's log applies to the facts it folds (pure, no Redis).

A reader refuses a fact that contradicts the log it has read, whoever wrote it: the run's
Redis ACLs keep other writers off the trainer's facts, and readers never fold them when they
get in anyway. These are the rules shared by several readers; the trainer's own fold has
more (trainer.state).
"""

from __future__ import annotations

__all__ = ["run_finished_refusal"]


def run_finished_refusal(steps: int, last_step: int) -> str | None:
    """Why a ``RunFinished(steps)`` read after the StepFinished of ``last_step`` (0: none)
    is not believed, or None. The trainer writes it after the StepFinished of its last step,
    saying that step: any other count contradicts the log."""
    if steps < 1:
        return f"RunFinished(steps={steps}): a run finishes after at least one step"
    if steps != last_step:
        return (f"RunFinished(steps={steps}) contradicts the log: its last StepFinished is of "
                f"step {last_step}")
    return None
