"""Reward functions the integration tests load by import path (``task.reward_fn``)."""

from __future__ import annotations

from tasks.digits import digits_reward


def fail_on_nines(response: str, answer: str) -> float:
    """Raises for prompts whose answer starts with 9 (a deterministic bad verifier)."""
    if answer.startswith("9"):
        raise RuntimeError(f"verifier crashed on {answer!r}")
    return digits_reward(response, answer)


def always_fail(response: str, answer: str) -> float:
    raise RuntimeError("verifier is down")
