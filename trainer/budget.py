"""The staleness budget: how many prompt tickets the trainer may have in flight.

verl's formula, in prompts (each ticket is one prompt with ``rollout.n`` responses)::

    budget = floor((1 + staleness_threshold) * trigger_parameter_sync_step
                   * require_batches * ppo_mini_batch_size)

Tickets outstanding (issued, not yet trained or discarded) never exceed ``budget``. The trainer
is the only issuer, so the bound is exact however many rollouter replicas claim tickets.
"""

from __future__ import annotations

import math

import msgspec

__all__ = ["TicketBudget", "max_staleness", "ticket_budget"]


def ticket_budget(
    staleness_threshold: float,
    trigger_parameter_sync_step: int,
    require_batches: int,
    ppo_mini_batch_size: int,
) -> int:
    """Tickets (prompts) that may be in flight at once."""
    per_sync = trigger_parameter_sync_step * require_batches * ppo_mini_batch_size
    # The epsilon keeps 1.5 * 16 = 24 from becoming 23.999999 -> 23.
    return max(per_sync, math.floor((1 + staleness_threshold) * per_sync + 1e-9))


def max_staleness(
    staleness_threshold: float, trigger_parameter_sync_step: int, require_batches: int = 1,
    ppo_mini_batch_size: int = 1,
) -> int:
    """The most weight versions a trained sample may lag behind the trainer's weights.

    A ticket issued after step ``j`` (weights version ``j // T``) is, when tickets are trained in
    issue order, trained by step ``j + ceil(budget / per_step)``, where the trainer holds version
    ``(step - 1) // T``. Groups that arrive later than that are discarded, so this is exact.
    """
    t = trigger_parameter_sync_step
    per_step = require_batches * ppo_mini_batch_size
    budget = ticket_budget(staleness_threshold, t, require_batches, ppo_mini_batch_size)
    horizon = math.ceil(budget / per_step)
    return max((j + horizon - 1) // t - j // t for j in range(t))


class TicketBudget(msgspec.Struct):
    """Counts issued and completed tickets; :meth:`room` says how many may be issued now."""

    capacity: int
    issued: int = 0
    completed: int = 0

    @property
    def outstanding(self) -> int:
        return self.issued - self.completed

    def room(self) -> int:
        return max(0, self.capacity - self.outstanding)

    def take(self, count: int) -> None:
        if count > self.room():
            raise ValueError(f"issuing {count} tickets exceeds the budget ({self.room()} left)")
        self.issued += count

    def complete(self, count: int) -> None:
        if count > self.outstanding:
            raise ValueError(f"completing {count} tickets but only {self.outstanding} are out")
        self.completed += count
