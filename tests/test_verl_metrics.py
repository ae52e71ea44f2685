"""verl's data and timing metrics in each StepFinished (trainer.metrics.verl_step_metrics):
verl's names (metric_utils.compute_data_metrics / compute_timing_metrics) and definitions,
on samples made up here."""

from __future__ import annotations

import numpy as np
import pytest

from runschema.messages import Array, Sample
from trainer.metrics import verl_step_metrics


def _sample(i: int, prompt: int, response: int, *, rank: int = 0, gen: float = 1.0,
            reward_s: float = 0.0, ts: float = 100.0) -> Sample:
    return Sample(
        sample_id=f"t{i}/0", ticket_id=f"t{i}", prompt_id=f"p{i}", index=0, n=1,
        prompt_tokens=Array.of(np.arange(prompt, dtype=np.int32)),
        response_tokens=Array.of(np.arange(response, dtype=np.int32)),
        logprobs=Array.of(np.zeros(response, dtype=np.float32)), reward=0.0,
        min_version=0, max_version=0, rank=rank, gen_time_s=gen, reward_s=reward_s,
        ts=ts)


def test_lengths_and_clip_ratio_as_verl_computes_them() -> None:
    samples = [_sample(0, 4, 5), _sample(1, 6, 2), _sample(2, 5, 5), _sample(3, 5, 8)]
    m = verl_step_metrics(samples, max_response_length=8, update_s=0.5)
    assert m["response_length/mean"] == pytest.approx((5 + 2 + 5 + 8) / 4)
    assert m["response_length/max"] == 8.0
    # verl: the share of responses whose length equals max_response_length.
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 4)
    assert m["prompt_length/mean"] == pytest.approx(5.0)
    assert m["timing_s/update_actor"] == 0.5


def test_generation_seconds_count_each_batch_once_and_rewards_add_up() -> None:
    # Two batches on rollouter 0 (1.5 s, then 2.0 s), one on rollouter 1 (1.5 s, at the
    # same time): the samples of a batch share its wall time (made a few us apart).
    samples = [_sample(0, 3, 2, gen=1.5, reward_s=0.1, ts=101.5),
               _sample(1, 3, 2, gen=1.5, reward_s=0.2, ts=101.500001),
               _sample(2, 3, 2, gen=2.0, reward_s=0.3, ts=103.6),
               _sample(3, 3, 2, rank=1, gen=1.5, reward_s=0.4, ts=101.5)]
    m = verl_step_metrics(samples, max_response_length=8, update_s=0.0)
    assert m["timing_s/gen"] == pytest.approx(1.5 + 2.0 + 1.5, abs=1e-5)
    assert m["timing_s/reward"] == pytest.approx(0.1 + 0.2 + 0.3 + 0.4)


def test_tickets_that_ran_side_by_side_count_their_wall_time_once() -> None:
    # vLLM (continuous admission): tickets 100-104, 101-103 and 103.5-106 on one replica
    # cover 100-106 (6 s), not 4 + 2 + 2.5 s.
    samples = [_sample(0, 3, 2, gen=4.0, ts=104.0), _sample(1, 3, 2, gen=2.0, ts=103.0),
               _sample(2, 3, 2, gen=2.5, ts=106.0)]
    m = verl_step_metrics(samples, max_response_length=8, update_s=0.0)
    assert m["timing_s/gen"] == pytest.approx(6.0)


def test_a_step_without_samples_reports_only_its_update() -> None:
    assert verl_step_metrics([], max_response_length=8, update_s=0.25) == {
        "timing_s/update_actor": 0.25}
