"""Bounded retries with exponential backoff and jitter, within one wall-clock budget.

:class:`RetryPolicy` describes how long to wait between tries and when to give up;
:func:`retry_async` runs an awaitable factory under it. The bus uses it for every Redis
command, so a client rides out a Redis restart shorter than the budget and then fails loudly
instead of retrying forever.

The bound is wall-clock time, not a count of tries: a try that hangs (a stopped server
accepts the connection and never answers) uses up the budget like a refused connection does,
so the give-up time is the budget whatever the failure (before, 10 tries of a 30 s deadline
each made a silent 5 minutes).

>>> p = RetryPolicy(base_s=0.25, max_s=1.0, jitter=0.0, budget_s=60.0)
>>> p.next_delay_s(tries=1, elapsed_s=2.0)   # the wait before the second try
0.25
>>> p.next_delay_s(tries=40, elapsed_s=59.5) is None  # a try could not start within 60 s
True
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["BUDGET_S", "FIRST_CONTACT_S", "RetryHook", "RetryPolicy", "retry_async"]

T = TypeVar("T")

RetryHook = Callable[[int, BaseException], None]
"""Called ``(attempt, error)`` before each retry wait of one call."""

BUDGET_S = 600.0
"""How long one command waits for Redis, from its first try, before it gives up (plus the
time it asked to block): ``redis.give_up_s``'s default. Ten minutes: a restart that reloads a
large AOF (minutes for tens of GB), a Sentinel or Cluster failover (``down-after`` plus the
election: well under a minute by default) or a paused VM migrated, with room to spare; a
week-long run then needs nobody to restart it. Silence is said every 10 s meanwhile
(bus.client), so the wait is never silent. Time this process itself did not run is not
counted (bus.reach)."""

FIRST_CONTACT_S = 10.0
"""The budget while a client has never had an answer (a wrong URL, a server not started yet):
short, because the one-line error is then the most useful thing to say."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Tries until one succeeds, ``budget_s`` has passed since the first began, or
    ``attempts`` tries were made (``None``: no count, only the budget). The wait before try
    ``k+1`` is ``min(max_s, base_s * 2**(k-1))`` shortened by a random fraction up to
    ``jitter`` (0..1), so many clients reconnecting after a restart do not arrive in lockstep.
    ``first_contact_s`` replaces ``budget_s`` for a client that has never been answered."""

    attempts: int | None = None
    base_s: float = 0.05
    max_s: float = 2.0
    jitter: float = 0.5
    budget_s: float = BUDGET_S
    first_contact_s: float = FIRST_CONTACT_S

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.base_s < 0 or self.max_s < 0:
            raise ValueError("RetryPolicy delays must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")
        if self.budget_s <= 0 or self.first_contact_s <= 0:
            raise ValueError("RetryPolicy budgets must be > 0")

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed try number ``attempt`` (0-based)."""
        # Cap the exponent: 2**k overflows floats long before any sane attempts count.
        raw = min(self.max_s, self.base_s * (2.0 ** min(attempt, 60)))
        if self.jitter:
            raw *= 1.0 - self.jitter * (rng or random).random()
        return raw

    def next_delay_s(
        self,
        tries: int,
        elapsed_s: float,
        budget_s: float | None = None,
        rng: random.Random | None = None,
    ) -> float | None:
        """After ``tries`` failed tries, ``elapsed_s`` after the first began: the wait before
        the next try, or ``None`` to give up (``attempts`` tries made, or the next try would
        begin at or past ``budget_s``, default :attr:`budget_s`)."""
        if self.attempts is not None and tries >= self.attempts:
            return None
        delay = self.delay_s(tries - 1, rng)
        if elapsed_s + delay >= (self.budget_s if budget_s is None else budget_s):
            return None
        return delay


async def retry_async(
    policy: RetryPolicy,
    fn: Callable[[float], Awaitable[T]],
    *,
    retry_on: tuple[type[BaseException], ...],
    no_retry: tuple[type[BaseException], ...] = (),
    on_retry: Callable[[int, BaseException], None] | None = None,
    budget_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Await ``fn(left_s)`` until it succeeds, retrying on ``retry_on`` (never on
    ``no_retry``) while :meth:`RetryPolicy.next_delay_s` allows. ``left_s`` is the budget
    (``budget_s``, default the policy's) left when the try begins: a try that must not
    outlive the budget bounds itself with it.

    When it gives up, the last error is re-raised unchanged; callers wrap it.
    ``on_retry(attempt, exc)`` runs before each wait (e.g. to reset state before a re-read).
    """
    budget = policy.budget_s if budget_s is None else budget_s
    start = clock()
    attempt = 0
    while True:
        try:
            return await fn(budget - (clock() - start))
        except no_retry:
            raise
        except retry_on as exc:
            delay = policy.next_delay_s(attempt + 1, clock() - start, budget)
            if delay is None:
                raise
            if on_retry is not None:
                on_retry(attempt, exc)
            await asyncio.sleep(delay)
            attempt += 1
