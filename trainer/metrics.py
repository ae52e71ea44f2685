"""What the trainer reports with each StepFinished beside the update's own metrics.

Names are verl's where verl has one (``staleness/*``, ``throughput/*``); the rest say what
they count. ``trainer/idle_ratio`` is the share of the step the worker had nothing to compute
while the trainer waited for samples; ``trainer/update_s`` the worker's compute time;
``trainer/loop_cpu_s`` the CPU the event loop spent since the previous step (reading,
decoding and checking samples, publishing): with the trainer on one core a step takes about
``update_s + loop_cpu_s``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainer.intake import Group, Intake
from trainer.ledger import Ledger

if TYPE_CHECKING:
    from trainer.watch import Watch

__all__ = ["StepMeter"]


class StepMeter:
    """Counters the trainer keeps across steps for its metrics."""

    def __init__(self) -> None:
        self.wait_s = 0.0
        """This step's time with nothing to compute, waiting for samples."""
        self.loop_cpu_at = time.thread_time()
        """The event loop thread's CPU time at the last StepFinished."""
        self.window_groups = 0
        """Prompts trained in this sync window, and how many were possibly stale."""
        self.window_stale = 0

    def window_stale_share(self, groups: Sequence[Group], version: int) -> float:
        """verl's per-window view: the share of this sync window's prompts generated with
        weights older than the trainer's (at most staleness_threshold)."""
        self.window_groups += len(groups)
        self.window_stale += sum(1 for g in groups if g.possibly_stale(version))
        return self.window_stale / self.window_groups

    def synced(self) -> None:
        """A weight sync opens a new window."""
        self.window_groups = self.window_stale = 0

    def loop_cpu(self) -> float:
        """The event loop's CPU since the last call (call it on the loop's thread: it
        shares the core with the update)."""
        now = time.thread_time()
        spent, self.loop_cpu_at = now - self.loop_cpu_at, now
        return spent

    def idle_ratio(self, duration: float) -> float:
        return min(1.0, self.wait_s / duration) if duration > 0 else 0.0

    def report(self, duration: float, n_samples: int, *, update_s: float, ledger: Ledger,
               capacity: int, reissued: int, intake: Intake, watch: Watch) -> dict[str, float]:
        """The run's gauges at the end of a step (call it on the event loop's thread)."""
        return {
            "trainer/idle_ratio": self.idle_ratio(duration),
            "trainer/update_s": update_s,
            "trainer/loop_cpu_s": self.loop_cpu(),
            "rollouter/idle_ratio": watch.idle_ratio(),
            "samples/queue_depth": float(intake.queued_samples()),
            "throughput/samples_per_s": n_samples / duration if duration > 0 else 0.0,
            "tickets/issued": float(ledger.issued),
            "tickets/outstanding": float(ledger.outstanding),
            "tickets/budget": float(capacity),
            "tickets/reissued": float(reissued),
            "samples/refused": float(intake.refused),
            "rollout/failures": float(watch.rollout_failures),
            "staleness/discarded_groups": float(intake.discarded),
        }
