"""The staleness budget, with verl's fully-async meaning.

verl's formula, in prompts (each ticket is one prompt with ``rollout.n`` responses)::

    budget = floor((1 + staleness_threshold) * trigger_parameter_sync_step
                   * require_batches * ppo_mini_batch_size)

is the most prompts a *sync window* (the steps between two weight syncs) may have generated
for it. As in verl's rollouter, the count restarts at each weight sync from what is still
queued or in flight (issued, not yet trained) and grows by one per ticket issued; it does not
shrink when a ticket is trained. So after a sync at most ``budget - T * R * M`` tickets of
the window can come from older weights: the stale share of a window is at most
``staleness_threshold`` (0: every sample on-policy). The trainer is the only issuer, so the
bound is exact however many rollouter replicas claim tickets. The window count itself is
folded from events in :mod:`trainer.ledger`.
"""

from __future__ import annotations

import math

__all__ = ["max_staleness", "stale_share_bound", "ticket_budget"]


def ticket_budget(
    staleness_threshold: float,
    trigger_parameter_sync_step: int,
    require_batches: int,
    ppo_mini_batch_size: int,
) -> int:
    """Tickets (prompts) one sync window may issue, counting those still out at its start."""
    per_sync = trigger_parameter_sync_step * require_batches * ppo_mini_batch_size
    # The epsilon keeps 1.5 * 16 = 24 from becoming 23.999999 -> 23.
    return max(per_sync, math.floor((1 + staleness_threshold) * per_sync + 1e-9))


def stale_share_bound(
    staleness_threshold: float,
    trigger_parameter_sync_step: int,
    require_batches: int,
    ppo_mini_batch_size: int,
) -> float:
    """The largest share of a sync window's trained prompts that older weights generated:
    the tickets carried over a sync, over the prompts one window trains."""
    per_sync = trigger_parameter_sync_step * require_batches * ppo_mini_batch_size
    budget = ticket_budget(staleness_threshold, trigger_parameter_sync_step, require_batches,
                           ppo_mini_batch_size)
    return (budget - per_sync) / per_sync


def max_staleness(
    staleness_threshold: float, trigger_parameter_sync_step: int = 1, require_batches: int = 1,
    ppo_mini_batch_size: int = 1,
) -> int:
    """The most weight versions a trained sample may lag behind the trainer's weights.

    Tickets are issued only at syncs, tagged with the new version. At most ``budget -
    per_sync`` of them are still out at the next sync; trained first (in issue order), they
    are one version old; a carry-over larger than one window (``staleness_threshold > 1``)
    adds a version per window. Groups that arrive later than that are answered again.
    """
    per_sync = trigger_parameter_sync_step * require_batches * ppo_mini_batch_size
    budget = ticket_budget(staleness_threshold, trigger_parameter_sync_step, require_batches,
                           ppo_mini_batch_size)
    return math.ceil((budget - per_sync) / per_sync)
