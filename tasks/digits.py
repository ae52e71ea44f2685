"""Default task: reverse a string of digits. Prompt "123>", answer "321"."""

from __future__ import annotations

import random

from tasks import Prompt

__all__ = ["DigitsPrompts", "digits_reward"]


class DigitsPrompts:
    """Deterministic stream of digit-reversal prompts: prompt i depends only on (seed, i)."""

    def __init__(self, seed: int = 0, min_digits: int = 3, max_digits: int = 4) -> None:
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        self.seed = seed
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.index = 0

    def get(self, index: int) -> Prompt:
        # A str seed goes through sha512, so this is stable across processes and Pythons.
        rng = random.Random(f"digits/{self.seed}/{index}")
        n = rng.randint(self.min_digits, self.max_digits)
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        return Prompt(f"p{index}", digits + ">", digits[::-1])

    def next(self) -> Prompt:
        p = self.get(self.index)
        self.index += 1
        return p


def digits_reward(response: str, answer: str, length_penalty: float = 1.0) -> float:
    """Fraction of answer positions the response gets right, in [0, 1].

    A response longer than the answer is scaled by 1 - length_penalty * extra / len(response)
    (with the default 1.0 that is correct / max(len(answer), len(response))), so stopping at
    the right place pays, while a random policy still earns a little: GRPO needs differences
    within a group to learn anything.
    """
    if not answer:
        return 1.0 if not response else 1.0 - length_penalty
    correct = sum(a == b for a, b in zip(response, answer, strict=False))
    extra = max(0, len(response) - len(answer))
    return correct / len(answer) * (1.0 - length_penalty * extra / max(1, len(response)))
