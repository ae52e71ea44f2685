"""verl's metrics in each StepFinished (trainer.metrics): verl's names
(metric_utils.compute_data_metrics / compute_timing_metrics / compute_throughout_metrics, the
fully-async trainer's and rollouter's) and definitions, on samples made up here.
:data:`VERL_STEP_METRICS` is the list a real run's steps are held against
(tests/test_hf_export.py)."""

from __future__ import annotations

import numpy as np
import pytest

from runschema.messages import Array, Sample
from trainer.metrics import AsyncCounts, StepShape, critic_metrics, verl_step_metrics

VERL_STEP_METRICS = (
    *(f"critic/{what}/{stat}" for what in ("score", "rewards", "advantages", "returns")
      for stat in ("mean", "max", "min")),
    *(f"{what}/{stat}" for what in ("response_length", "response_length_non_aborted",
                                    "prompt_length")
      for stat in ("mean", "max", "min", "clip_ratio")),
    "response/aborted_ratio",
    *(f"timing_s/{what}" for what in ("step", "gen", "reward", "update_actor",
                                      "update_weights", "save_checkpoint")),
    "timing_per_token_ms/gen", "timing_per_token_ms/update_actor",
    "perf/total_num_tokens", "perf/time_per_step", "perf/throughput", "perf/cpu_memory_used_gb",
    "training/global_step", "training/epoch",
    *(f"actor/{what}" for what in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl",
                                   "entropy", "grad_norm", "lr")),
    "training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_std",
    *(f"fully_async/count/{what}" for what in (
        "stale_samples_processed", "stale_trajectory_processed", "current_param_version",
        "staleness_samples", "dropped_stale_samples")),
    *(f"fully_async/partial/{what}" for what in (
        "total_partial_num", "partial_ratio", "max_partial_span")),
    *(f"fully_async/processing_time/{what}" for what in (
        "avg", "max", "min", "tp50", "tp95", "tp99")),
    "fully_async/total_wait_time", "fully_async/trainer/idle_ratio",
    "fully_async/rollouter/idle_ratio", "fully_async/monitor/queue/mq_queue_size",
    *(f"fully_async/static/{what}" for what in (
        "required_samples", "max_required_samples", "staleness_threshold")),
)
"""verl's names a step of every rlbus run carries (docs/config.md says which verl names it
does not, and why)."""


def _shape(update_s: float = 0.0, *, duration: float = 2.0, devices: int = 2,
           max_prompt: int = 6, max_response: int = 8, step: int = 3,
           epoch: int = 0) -> StepShape:
    return StepShape(step=step, duration_s=duration, update_s=update_s, devices=devices,
                     max_prompt_length=max_prompt, max_response_length=max_response,
                     epoch=epoch)


def _sample(i: int, prompt: int, response: int, *, rank: int = 0, gen: float = 1.0,
            reward_s: float = 0.0, ts: float = 100.0, reward: float = 0.0,
            versions: tuple[int, int] = (0, 0)) -> Sample:
    return Sample(
        sample_id=f"t{i}/0", ticket_id=f"t{i}", prompt_id=f"p{i}", index=0, n=1,
        prompt_tokens=Array.of(np.arange(prompt, dtype=np.int32)),
        response_tokens=Array.of(np.arange(response, dtype=np.int32)),
        logprobs=Array.of(np.zeros(response, dtype=np.float32)), reward=reward,
        min_version=versions[0], max_version=versions[1], rank=rank, gen_time_s=gen,
        reward_s=reward_s,
        ts=ts)


def test_lengths_and_clip_ratio_as_verl_computes_them() -> None:
    samples = [_sample(0, 4, 5), _sample(1, 6, 2), _sample(2, 5, 5), _sample(3, 5, 8)]
    m = verl_step_metrics(samples, _shape(0.5))
    assert m["response_length/mean"] == pytest.approx((5 + 2 + 5 + 8) / 4)
    assert m["response_length/max"] == 8.0 and m["response_length/min"] == 2.0
    # verl: the share of responses whose length equals max_response_length.
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 4)
    assert m["prompt_length/mean"] == pytest.approx(5.0)
    assert (m["prompt_length/max"], m["prompt_length/min"]) == (6.0, 4.0)
    assert m["prompt_length/clip_ratio"] == pytest.approx(1 / 4)  # data.max_prompt_length 6
    assert m["timing_s/update_actor"] == 0.5
    assert m["response/aborted_ratio"] == 0.0
    assert m["response_length_non_aborted/mean"] == m["response_length/mean"]
    # perf: every token of the step, per second of the step and device.
    assert m["perf/total_num_tokens"] == 20 + 20
    assert m["perf/time_per_step"] == 2.0
    assert m["perf/throughput"] == pytest.approx(40 / (2.0 * 2))
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(0.5 * 1000 / 40)
    assert m["timing_per_token_ms/gen"] == pytest.approx(m["timing_s/gen"] * 1000 / 20)
    assert (m["training/global_step"], m["training/epoch"]) == (3.0, 0.0)


def test_an_aborted_response_is_left_out_where_verl_leaves_it_out() -> None:
    samples = [_sample(0, 4, 0, reward=0.0), _sample(1, 4, 4, reward=1.0),
               _sample(2, 4, 8, reward=0.5)]
    m = verl_step_metrics(samples, _shape())
    assert m["response/aborted_ratio"] == pytest.approx(1 / 3)
    assert m["response_length/min"] == 0.0
    assert m["response_length_non_aborted/min"] == 4.0
    assert m["response_length_non_aborted/mean"] == 6.0
    assert m["response_length_non_aborted/clip_ratio"] == pytest.approx(1 / 2)
    c = critic_metrics([0.0, 1.0, 0.5], [-1.0, 1.0, 0.25], [0, 4, 8])
    assert (c["critic/score/mean"], c["critic/score/max"], c["critic/score/min"]) == (
        0.75, 1.0, 0.5)
    assert c["critic/rewards/mean"] == c["critic/score/mean"]
    # Advantages over response tokens: the aborted sample has none.
    assert c["critic/advantages/mean"] == pytest.approx((1.0 * 4 + 0.25 * 8) / 12)
    assert (c["critic/advantages/max"], c["critic/advantages/min"]) == (1.0, 0.25)
    assert all(c[k.replace("advantages", "returns")] == v for k, v in c.items()
               if k.startswith("critic/advantages/"))
    # Every response aborted: NaN, as verl.
    assert np.isnan(critic_metrics([1.0], [0.0], [0])["critic/score/mean"])


def test_the_run_counts_go_on_from_the_last_step_and_partial_responses_are_counted() -> None:
    counts = AsyncCounts({"fully_async/count/stale_samples_processed": 5.0,
                          "fully_async/count/stale_trajectory_processed": 7.0})
    groups = [[_sample(0, 2, 2, versions=(2, 3), gen=1.0), _sample(1, 2, 2, versions=(3, 3),
                                                                  gen=2.0)],
              [_sample(2, 2, 2, versions=(1, 2), gen=3.0), _sample(3, 2, 2, versions=(1, 1),
                                                                  gen=4.0)]]
    m = counts.step(groups, version=3)
    # Both groups hold a response begun on weights older than v3; three responses ended on
    # older weights than v3.
    assert m["fully_async/count/stale_samples_processed"] == 5 + 2
    assert m["fully_async/count/stale_trajectory_processed"] == 7 + 2
    assert m["fully_async/partial/total_partial_num"] == 2.0
    assert m["fully_async/partial/partial_ratio"] == 0.5
    assert m["fully_async/partial/max_partial_span"] == 1.0
    times = [1.0, 2.0, 3.0, 4.0]
    assert m["fully_async/processing_time/avg"] == 2.5
    for q in (50, 95, 99):  # numpy's percentiles, as verl takes them
        assert m[f"fully_async/processing_time/tp{q}"] == pytest.approx(np.percentile(times, q))
    assert counts.step([], version=4)["fully_async/count/stale_samples_processed"] == 7


def test_generation_seconds_count_each_batch_once_and_rewards_add_up() -> None:
    # Two batches on rollouter 0 (1.5 s, then 2.0 s), one on rollouter 1 (1.5 s, at the
    # same time): the samples of a batch share its wall time (made a few us apart).
    samples = [_sample(0, 3, 2, gen=1.5, reward_s=0.1, ts=101.5),
               _sample(1, 3, 2, gen=1.5, reward_s=0.2, ts=101.500001),
               _sample(2, 3, 2, gen=2.0, reward_s=0.3, ts=103.6),
               _sample(3, 3, 2, rank=1, gen=1.5, reward_s=0.4, ts=101.5)]
    m = verl_step_metrics(samples, _shape())
    assert m["timing_s/gen"] == pytest.approx(1.5 + 2.0 + 1.5, abs=1e-5)
    assert m["timing_s/reward"] == pytest.approx(0.1 + 0.2 + 0.3 + 0.4)


def test_tickets_that_ran_side_by_side_count_their_wall_time_once() -> None:
    # vLLM (continuous admission): tickets 100-104, 101-103 and 103.5-106 on one replica
    # cover 100-106 (6 s), not 4 + 2 + 2.5 s.
    samples = [_sample(0, 3, 2, gen=4.0, ts=104.0), _sample(1, 3, 2, gen=2.0, ts=103.0),
               _sample(2, 3, 2, gen=2.5, ts=106.0)]
    m = verl_step_metrics(samples, _shape())
    assert m["timing_s/gen"] == pytest.approx(6.0)


def test_a_step_without_samples_reports_only_its_update() -> None:
    assert verl_step_metrics([], _shape(0.25, step=4, epoch=1)) == {
        "timing_s/update_actor": 0.25, "perf/time_per_step": 2.0,
        "training/global_step": 4.0, "training/epoch": 1.0}

