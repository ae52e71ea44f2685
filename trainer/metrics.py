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
- ``response_length/min``, ``response_length_non_aborted/*``, ``response/aborted_ratio``
  (an aborted response is an empty one), ``prompt_length/max|min|clip_ratio``
  (``data.max_prompt_length``), ``perf/total_num_tokens|time_per_step|throughput``
  (``compute_throughout_metrics``: tokens per second of the step's window and device),
  ``timing_per_token_ms/gen|update_actor``, ``training/global_step|epoch``.
- with conversations (rollout.multi_turn): ``num_turns/mean|max|min`` and
  ``tool_call_counts/mean|max|min`` (:func:`conversation_metrics`). A conversation's
  ``response_length`` counts every token after the prompt, tool answers included, as verl's
  (its attention mask over the response); the loss trains the assistant tokens only.

:func:`critic_metrics` (called by the update, which has the advantages) adds
``critic/score|rewards|advantages|returns/*``; :class:`AsyncCounts` and
:func:`step_gauges` the fully-async trainer's ``fully_async/*``. docs/config.md lists every
name beside verl's definition.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from runschema.messages import Sample
from trainer.actions import Measured
from trainer.intake import Group, Intake
from trainer.ledger import Ledger
from trainer.state import RUNNING_COUNTS

if TYPE_CHECKING:
    from trainer.health import Health

__all__ = ["AsyncCounts", "StaleWindow", "StepMeter", "StepShape", "conversation_metrics",
           "critic_metrics", "step_gauges", "verl_step_metrics"]


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
        # verl's fully-async names of the same gauges (its trainer's idle is its wait for
        # samples over the step; its queue holds prompts' groups; its budget is in prompts).
        "fully_async/trainer/idle_ratio": idle,
        "fully_async/total_wait_time": measured.wait_s,
        "fully_async/rollouter/idle_ratio": health.idle_ratio(),
        "fully_async/monitor/queue/mq_queue_size": float(intake.queued_groups()),
        "fully_async/count/staleness_samples": float(ledger.window),
        "fully_async/count/dropped_stale_samples": float(intake.discarded),
        "fully_async/static/max_required_samples": float(capacity),
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


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    """``name/mean|max|min`` of ``values`` (NaN where there are none, as verl)."""
    if not values:
        return {f"{name}/{k}": math.nan for k in ("mean", "max", "min")}
    return {f"{name}/mean": sum(values) / len(values), f"{name}/max": float(max(values)),
            f"{name}/min": float(min(values))}


def critic_metrics(rewards: Sequence[float], advantages: Sequence[float],
                   lengths: Sequence[int]) -> dict[str, float]:
    """verl's ``critic/score|rewards|advantages|returns/mean|max|min`` of one step's samples
    (their rewards, the advantages they trained with, their response lengths), as
    ``compute_data_metrics`` takes them: scores and rewards over the samples with a response
    (an empty one is aborted), advantages and returns over response tokens (a sample's
    advantage counts once per token). With no KL in the reward (``use_kl_in_reward`` is
    fixed False here) the reward is the score; for GRPO verl's returns are the advantages."""
    scores = [r for r, n in zip(rewards, lengths, strict=True) if n > 0]
    tokens = sum(n for n in lengths if n > 0)
    out = {**_stats("critic/score", scores), **_stats("critic/rewards", scores)}
    live = [a for a, n in zip(advantages, lengths, strict=True) if n > 0]
    adv = _stats("critic/advantages", live)
    if live:
        adv["critic/advantages/mean"] = sum(
            a * n for a, n in zip(advantages, lengths, strict=True)) / tokens
    out.update(adv)
    out.update({k.replace("advantages", "returns"): v for k, v in adv.items()})
    return out


def _percentile(ordered: Sequence[float], q: float) -> float:
    """numpy's default (linear) percentile ``q`` of ``ordered`` (sorted, not empty)."""
    at = (len(ordered) - 1) * q / 100
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


class StepShape(NamedTuple):
    """What the step core knows of a step beyond its samples (see :func:`verl_step_metrics`)."""

    step: int
    duration_s: float
    """The step's window (``timing_s/step``)."""
    update_s: float
    devices: int
    """The run's devices: trainer ranks + live rollouter replicas x their tensor-parallel
    size (verl's ``total_gpus``: trainer and rollout GPUs)."""
    max_prompt_length: int
    max_response_length: int
    epoch: int = 0


def verl_step_metrics(samples: Sequence[Sample], shape: StepShape) -> dict[str, float]:
    """verl's data, timing and throughput metrics of one step (see the module docstring)."""
    base = {"training/global_step": float(shape.step), "training/epoch": float(shape.epoch),
            "timing_s/update_actor": shape.update_s, "perf/time_per_step": shape.duration_s}
    if not samples:
        return base
    responses = [len(s.response_tokens) for s in samples]
    prompts = [len(s.prompt_tokens) for s in samples]
    n = len(samples)
    kept = [r for r in responses if r > 0]
    response_tokens, total = sum(responses), sum(responses) + sum(prompts)
    gen_s = _gen_seconds(samples)
    metrics = {
        **base,
        **_stats("response_length", responses),
        "response_length/clip_ratio": sum(r == shape.max_response_length
                                          for r in responses) / n,
        **_stats("response_length_non_aborted", kept),
        "response_length_non_aborted/clip_ratio": (
            sum(r == shape.max_response_length for r in kept) / len(kept) if kept
            else math.nan),
        "response/aborted_ratio": (n - len(kept)) / n,
        **_stats("prompt_length", prompts),
        "prompt_length/clip_ratio": sum(p == shape.max_prompt_length for p in prompts) / n,
        "timing_s/gen": gen_s,
        "timing_s/reward": float(sum(s.reward_s for s in samples)),
        "perf/total_num_tokens": float(total),
        "perf/throughput": (total / (shape.duration_s * max(shape.devices, 1))
                            if shape.duration_s > 0 else 0.0),
    }
    metrics.update(conversation_metrics(samples))
    if response_tokens:
        metrics["timing_per_token_ms/gen"] = gen_s * 1000 / response_tokens
    if total:
        metrics["timing_per_token_ms/update_actor"] = shape.update_s * 1000 / total
    return metrics


def conversation_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """verl's ``num_turns/*`` and ``tool_call_counts/*`` of a step with conversations
    (rollout.multi_turn): a single response counts 2 turns, as verl's single-turn agent
    loop says; and rlbus's ``tool_calls/failure_ratio``, the share of the step's tool calls
    that ended in an error the model was told. None without conversations."""
    if not any(s.num_turns for s in samples):
        return {}
    calls = [s.tool_calls for s in samples]
    out = {**_stats("num_turns", [s.num_turns or 2 for s in samples]),
           **_stats("tool_call_counts", calls)}
    if sum(calls):
        out["tool_calls/failure_ratio"] = sum(s.tool_failures for s in samples) / sum(calls)
    return out


class AsyncCounts:
    """verl's ``fully_async/*`` figures of each step, with the run's running counts: folded
    step by step, and carried over a restart from the last StepFinished (``start``)."""

    COUNTS = RUNNING_COUNTS

    def __init__(self, start: dict[str, float] | None = None) -> None:
        start = start or {}
        self.stale_groups = int(start.get(self.COUNTS[0], 0))
        """Prompts (groups) trained with a response begun on weights older than the step's."""
        self.stale_responses = int(start.get(self.COUNTS[1], 0))
        """Responses trained that ended on weights older than the step's."""

    def step(self, groups: Sequence[Sequence[Sample]], version: int) -> dict[str, float]:
        """The step's figures: ``groups`` trained on weights ``version``."""
        flat = [s for g in groups for s in g]
        self.stale_groups += sum(any(s.min_version < version for s in g) for g in groups)
        self.stale_responses += sum(s.max_version < version for s in flat)
        spans = [s.max_version - s.min_version for s in flat]
        partial = sum(span > 0 for span in spans)
        out = {self.COUNTS[0]: float(self.stale_groups),
               self.COUNTS[1]: float(self.stale_responses),
               "fully_async/partial/total_partial_num": float(partial),
               "fully_async/partial/partial_ratio": partial / len(flat) if flat else 0.0,
               "fully_async/partial/max_partial_span": float(max(spans, default=0))}
        times = sorted(s.gen_time_s for s in flat)
        if times:
            out.update({"fully_async/processing_time/avg": sum(times) / len(times),
                        "fully_async/processing_time/max": times[-1],
                        "fully_async/processing_time/min": times[0],
                        **{f"fully_async/processing_time/tp{q}": _percentile(times, q)
                           for q in (50, 95, 99)}})
        return out
