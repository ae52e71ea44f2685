"""When the trainer writes a checkpoint of its own (trainer.resumepoints): pure, no I/O."""

from __future__ import annotations

import numpy as np

from runconfig import load_config
from runschema.messages import Array, Sample
from trainer.resumepoints import MB, ResumePoints, sample_bytes


def _points(*overrides: str) -> ResumePoints:
    return ResumePoints(load_config(None, ["trainer.save_freq=-1", *overrides]))


def _run(points: ResumePoints, steps: int, *, trigger: int = 1, saves: frozenset[int] =
         frozenset(), trained: int = 0) -> list[int]:
    return [k for k in range(1, steps + 1)
            if points.due(saved=k in saves, sync=k % trigger == 0, trained=trained)]


def test_every_n_steps_without_a_checkpoint() -> None:
    assert _run(_points("run.resume_point_steps=4"), 13) == [4, 8, 12]
    # A user checkpoint restarts the count.
    assert _run(_points("run.resume_point_steps=4"), 13, saves=frozenset({6})) == [4, 10]


def test_only_where_a_weights_window_ends() -> None:
    assert _run(_points("run.resume_point_steps=3"), 12, trigger=2) == [4, 8, 12]


def test_by_the_bytes_of_samples_trained() -> None:
    points = _points("run.resume_point_steps=0", "run.resume_point_mb=1")
    assert _run(points, 10, trained=MB // 3 + 1) == [3, 6, 9]


def test_off_when_nothing_is_trimmed_or_when_both_are_zero() -> None:
    assert _run(_points("run.resume_point_steps=2", "run.retention=all"), 10) == []
    assert _run(_points("run.resume_point_steps=0", "run.resume_point_mb=0"), 500,
                trained=10 * MB) == []


def test_sample_bytes_counts_the_arrays() -> None:
    def arr(n: int, dtype: str) -> Array:
        return Array.of(np.zeros(n, dtype=dtype))

    s = Sample(sample_id="t0/0", ticket_id="t0", prompt_id="p", index=0, n=1,
               prompt_tokens=arr(10, "int32"), response_tokens=arr(5, "int32"),
               logprobs=arr(5, "float32"), reward=1.0, min_version=0, max_version=0)
    assert sample_bytes([s, s]) == 2 * (40 + 20 + 20)


def test_a_resume_counts_the_steps_the_log_finished_after_its_checkpoint() -> None:
    points = ResumePoints(load_config(None, ["run.resume_point_steps=4"]), steps=2)
    assert [k for k in range(15, 23) if points.due(saved=False, sync=True, trained=0)] == [
        16, 20]


def test_a_resume_that_fell_back_past_a_bad_checkpoint_writes_one_at_its_first_sync() -> None:
    """Else retention, counting the bad file as the newest checkpoint, would delete the
    intact one it fell back to at the next checkpoint."""
    cfg = load_config(None, ["run.resume_point_steps=100"])
    assert _run(ResumePoints(cfg, steps=3, fell_back=True), 12, trigger=2) == [2]
    # A user checkpoint serves as well; off where nothing is trimmed.
    assert _run(ResumePoints(cfg, steps=3, fell_back=True), 12, trigger=2,
                saves=frozenset({2})) == []
    assert _run(ResumePoints(load_config(None, ["run.retention=all"]), fell_back=True),
                12) == []
