"""Default task: reverse a string of digits. Prompt "123>", answer "321"."""

from __future__ import annotations

import random

from tasks import Prompt

__all__ = ["DigitsPrompts", "digits_reward"]


class DigitsPrompts:
    """Deterministic stream of digit-reversal prompts: prompt i depends only on (seed, i)."""

    def __init__(self, seed: int = 0, min_digits: int = 4, max_digits: int = 4) -> None:
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


def digits_reward(response: str, answer: str) -> float:
    """Fraction of positions right, where stopping counts as one more position: response and
    answer both get an end mark, are compared position by position, and the count is divided
    by the longer of the two. So "321" for "321" scores 1, "3215" 3/5, "32" 2/4, "" 0.

    Scoring the stop like a character lets the policy learn where to stop independently of
    the digits (otherwise "right digits + one stray character" is a sticky local optimum),
    and a random policy still earns a little: GRPO needs differences within a group.
    """
    r, a = response + "\0", answer + "\0"
    correct = sum(x == y for x, y in zip(r, a, strict=False))
    return correct / max(len(r), len(a))
