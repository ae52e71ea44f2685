"""Reward functions the integration tests load by import path (``task.reward_fn``)."""

from __future__ import annotations

import time

from tasks.digits import digits_reward

SLOW_REWARD_S = 0.07
"""How late :func:`slow_digits` answers: a ticket of ``rollout.n=16`` takes 16 x 0.07 s =
1.12 s to answer, however fast the machine."""


def fail_on_nines(response: str, answer: str) -> float:
    """Raises for prompts whose answer starts with 9 (a deterministic bad verifier)."""
    if answer.startswith("9"):
        raise RuntimeError(f"verifier crashed on {answer!r}")
    return digits_reward(response, answer)


def always_fail(response: str, answer: str) -> float:
    raise RuntimeError("verifier is down")


def slow_digits(response: str, answer: str) -> float:
    """The digits reward, :data:`SLOW_REWARD_S` late (a slow verifier): makes a rollouter
    slow by a known amount, whatever the host's speed."""
    time.sleep(SLOW_REWARD_S)
    return digits_reward(response, answer)
