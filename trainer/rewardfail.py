"""Rewards that failed: counted in every step's metrics, and the run stopped above
``reward.max_failure_ratio`` (a reward function that fails is a failure: verl stops at its
first error, where training on the zeros would learn from noise).

Pure: the samples come in (each carries why its reward function gave no reward,
``Sample.reward_error``, and whether that was the timeout), metrics or a failure go out.

The window is one trainer step: the failed share of the step's samples (its groups of
``rollout.n`` responses, ``require_batches * ppo_mini_batch_size`` of them). Failures only
grow as groups join a step, so the run stops as soon as the groups taken so far put the
step's share above the ratio for certain: with 0 (the default) the first failed sample that
joins a step stops the run before the step is recorded, as verl stops at its first error;
with 1 nothing stops. A timed-out score counts as a failure: it is no reward either, and
verl, which has no reward timeout, would still be waiting for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from runconfig import Config
from runschema.messages import Sample
from runtime import Failure
from trainer.intake import Group

__all__ = ["RewardFailed", "RewardGuard", "reward_metrics"]


class RewardFailed(Failure):
    """The reward function failed on more of a step's samples than
    ``reward.max_failure_ratio`` allows; the message names it and its first error."""


def reward_metrics(samples: Iterable[Sample]) -> dict[str, float]:
    """A step's ``reward/failed_count`` (the reward function raised, or its worker died)
    and ``reward/timeout_count`` (it ran past ``rollout.reward_timeout_s``)."""
    failed = timeouts = 0
    for s in samples:
        timeouts += s.reward_timed_out
        failed += bool(s.reward_error) and not s.reward_timed_out
    return {"reward/failed_count": float(failed), "reward/timeout_count": float(timeouts)}


def reward_function(cfg: Config) -> str:
    """The reward function a run's samples are scored by, as the failure names it."""
    crf = cfg.custom_reward_function
    return f"{crf.path}:{crf.name}" if crf.path else "(the built-in scorer of the data source)"


class RewardGuard:
    """Judges the groups of the step being gathered against ``reward.max_failure_ratio``."""

    def __init__(self, cfg: Config) -> None:
        self.ratio = cfg.reward.max_failure_ratio
        self.n = cfg.rollout.n
        self.function = reward_function(cfg)

    def check(self, step: int, groups: Sequence[Group], need: int) -> None:
        """Raise RewardFailed when the failed samples of step ``step``'s ``groups`` (of the
        ``need`` it will have) are already more than the ratio of its samples."""
        failed = [s for g in groups for _, s in g.ordered() if s.reward_error]
        if not failed:
            return
        total = sum(g.n for g in groups) + max(0, need - len(groups)) * self.n
        if len(failed) / total > self.ratio:
            error = " ".join(failed[0].reward_error.split())  # one line, whatever it said
            raise RewardFailed(
                f"reward function {self.function} failed: {error} (on {len(failed)} of step "
                f"{step}'s {total} samples so far; reward.max_failure_ratio={self.ratio:g})")
