"""Bounded retries with exponential backoff and jitter.

:class:`RetryPolicy` describes how often and how long to retry; :func:`retry_async` runs an
awaitable factory under it. The bus uses it for every Redis command, so a client rides out a
Redis restart shorter than the bound and then fails loudly instead of retrying forever.

>>> RetryPolicy(attempts=3, base_s=0.25, max_s=1.0, jitter=0.0).total_delay_s()
0.75
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["RetryPolicy", "retry_async"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``attempts`` tries in total (1 = no retry); the wait before try ``k+1`` is
    ``min(max_s, base_s * 2**k)`` shortened by a random fraction up to ``jitter`` (0..1), so
    many clients reconnecting after a restart do not arrive in lockstep."""

    attempts: int = 10
    base_s: float = 0.05
    max_s: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.base_s < 0 or self.max_s < 0:
            raise ValueError("RetryPolicy delays must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed try number ``attempt`` (0-based)."""
        # Cap the exponent: 2**k overflows floats long before any sane attempts count.
        raw = min(self.max_s, self.base_s * (2.0 ** min(attempt, 60)))
        if self.jitter:
            raw *= 1.0 - self.jitter * (rng or random).random()
        return raw

    def total_delay_s(self) -> float:
        """The longest total wait (without jitter) before giving up."""
        return sum(
            min(self.max_s, self.base_s * (2.0 ** min(k, 60))) for k in range(self.attempts - 1)
        )


async def retry_async(
    policy: RetryPolicy,
    fn: Callable[[], Awaitable[T]],
    *,
    retry_on: tuple[type[BaseException], ...],
    no_retry: tuple[type[BaseException], ...] = (),
    on_retry: Callable[[int, BaseException], None] | None = None,
) -> T:
    """Await ``fn()`` until it succeeds, retrying on ``retry_on`` (but never on ``no_retry``).

    After the last attempt the last error is re-raised unchanged; callers wrap it.
    ``on_retry(attempt, exc)`` runs before each wait (e.g. to reset state before a re-read).
    """
    attempt = 0
    while True:
        try:
            return await fn()
        except no_retry:
            raise
        except retry_on as exc:
            if attempt + 1 >= policy.attempts:
                raise
            if on_retry is not None:
                on_retry(attempt, exc)
            await asyncio.sleep(policy.delay_s(attempt))
            attempt += 1
