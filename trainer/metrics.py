"""What the trainer reports with each StepFinished beside the update's own metrics.

Names are verl's where verl has one (``staleness/*``, ``throughput/*``); the rest say what
they count. ``trainer/idle_ratio`` is the share of the step the worker had nothing to compute
while the trainer waited for samples; ``trainer/update_s`` the worker's compute time;
``trainer/loop_cpu_s`` the CPU the event loop spent since the previous step (reading,
decoding and checking samples, publishing): with the trainer on one core a step takes about
``update_s + loop_cpu_s``. ``trainer/early_groups``: the step's groups read while the step
before it closed, whose mini-batches trained behind its weights (the step boundary
overlapped); ``timing_s/step`` and its laps: trainer.timing.

:func:`verl_step_metrics` adds the figures verl users read, with verl's names and
definitions (verl/trainer/ppo/metric_utils.py ``compute_data_metrics`` and
``compute_timing_metrics``), over the samples the step trained:

- ``response_length/mean|max``: response tokens per sample; ``response_length/clip_ratio``:
  the share whose length equals the longest allowed (``rollout.max_new_tokens``, verl's
  ``max_response_length``); ``prompt_length/mean``: prompt tokens per sample.
- ``timing_s/gen``: wall seconds the rollouters spent generating the step's samples, summed
  over the replicas (per replica, the union of the samples' spans ``ts - gen_time_s`` to
  ``ts``: a batch counts once, tickets that ran side by side in vLLM overlap). verl's
  synchronous trainer reports the wall time of generating the step's batch, which the sum
  equals when one rollouter generates the step's batches in turn; with R replicas in
  parallel the wall time is about the sum / R. (verl's fully-async trainer reports its wait
  for samples under this name; rlbus reports that as ``trainer/idle_ratio`` x the step.)
- ``timing_s/reward``: the scorer's seconds summed over the step's samples (``reward_s``),
  what verl's naive reward manager takes scoring them one after another.
- ``timing_s/update_actor``: the worker's compute time for the step's update (the same
  figure as ``trainer/update_s``; it includes building the batches).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from runschema.messages import Sample
from trainer.actions import Measured
from trainer.intake import Group, Intake
from trainer.ledger import Ledger

if TYPE_CHECKING:
    from trainer.health import Health

__all__ = ["StaleWindow", "StepMeter", "step_gauges", "verl_step_metrics"]


class StepMeter:
    """What the trainer's shell measures of a step by its clocks: the wait for samples
    with nothing to compute, and the event loop's CPU."""

    def __init__(self) -> None:
        self.wait_s = 0.0
        """This step's time with nothing to compute, waiting for samples."""
        self.loop_cpu_at = time.thread_time()
        """The event loop thread's CPU time at the last StepFinished."""

    def loop_cpu(self) -> float:
        """The event loop's CPU since the last call (call it on the loop's thread: it
        shares the core with the update)."""
        now = time.thread_time()
        spent, self.loop_cpu_at = now - self.loop_cpu_at, now
        return spent


class StaleWindow:
    """Prompts trained in this sync window, and how many were possibly stale."""

    def __init__(self) -> None:
        self.groups = 0
        self.stale = 0

    def share(self, groups: Sequence[Group], version: int) -> float:
        """verl's per-window view: the share of this sync window's prompts generated with
        weights older than the trainer's (at most staleness_threshold)."""
        self.groups += len(groups)
        self.stale += sum(1 for g in groups if g.possibly_stale(version))
        return self.stale / self.groups

    def synced(self) -> None:
        """A weight sync opens a new window."""
        self.groups = self.stale = 0


def step_gauges(duration: float, n_samples: int, measured: Measured, *, ledger: Ledger,
                capacity: int, reissued: int, intake: Intake, health: Health
                ) -> dict[str, float]:
    """The run's gauges at the end of a step of ``duration`` seconds."""
    idle = min(1.0, measured.wait_s / duration) if duration > 0 else 0.0
    return {
        "trainer/idle_ratio": idle,
        "trainer/update_s": measured.update_s,
        "trainer/loop_cpu_s": measured.loop_cpu_s,
        "rollouter/idle_ratio": health.idle_ratio(),
        "samples/queue_depth": float(intake.queued_samples()),
        "throughput/samples_per_s": n_samples / duration if duration > 0 else 0.0,
        "tickets/issued": float(ledger.issued),
        "tickets/outstanding": float(ledger.outstanding),
        "tickets/budget": float(capacity),
        "tickets/reissued": float(reissued),
        "samples/refused": float(intake.refused),
        "rollout/failures": float(health.rollout_failures),
        "staleness/discarded_groups": float(intake.discarded),
        **health.weights_sync(),
        **health.rollout_shares(),
    }


def _gen_seconds(samples: Sequence[Sample]) -> float:
    """Wall seconds the replicas spent generating ``samples``: a sample was generated in
    the ``gen_time_s`` up to its ``ts``; per replica, the union of those spans (a batch's
    samples share one; tickets that ran side by side in a streaming engine overlap), summed
    over the replicas."""
    spans: dict[int, set[tuple[float, float]]] = {}
    for s in samples:
        spans.setdefault(s.rank, set()).add((s.ts - s.gen_time_s, s.ts))
    total = 0.0
    for own in spans.values():
        covered = -math.inf
        for start, end in sorted(own):
            if end > covered:
                total += end - max(start, covered)
                covered = end
    return total


def verl_step_metrics(samples: Sequence[Sample], max_response_length: int,
                      update_s: float) -> dict[str, float]:
    """verl's data and timing metrics of one step (see the module docstring)."""
    if not samples:
        return {"timing_s/update_actor": update_s}
    responses = [len(s.response_tokens) for s in samples]
    prompts = [len(s.prompt_tokens) for s in samples]
    n = len(samples)
    return {
        "response_length/mean": sum(responses) / n,
        "response_length/max": float(max(responses)),
        "response_length/clip_ratio": sum(r == max_response_length for r in responses) / n,
        "prompt_length/mean": sum(prompts) / n,
        "timing_s/gen": _gen_seconds(samples),
        "timing_s/reward": float(sum(s.reward_s for s in samples)),
        "timing_s/update_actor": update_s,
    }
