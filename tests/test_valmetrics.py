"""verl's validation metrics (tasks.valmetrics): the figures, their bootstrap (verl's seed and
draws), majority voting and the val-core / val-aux naming rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.valmetrics import bootstrap_sizes, validation_metrics

rewards = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@st.composite
def validations(draw: st.DrawFn, n: int | None = None) -> tuple[list[str], list[int],
                                                                list[float], list[str]]:
    """Prompts (each of one of two sources) with ``n`` responses each: sources, uids,
    rewards and predictions, in verl's interleaved order."""
    n = draw(st.integers(1, 9)) if n is None else n
    prompts = draw(st.integers(1, 5))
    sources, uids, values, preds = [], [], [], []
    for p in range(prompts):
        source = draw(st.sampled_from(["gsm8k", "math"]))
        for _ in range(n):
            sources.append(source)
            uids.append(p)
            values.append(draw(rewards))
            preds.append(draw(st.sampled_from("abc")))
    return sources, uids, values, preds


@settings(max_examples=60, deadline=None)
@given(validations(n=1))
def test_mean_at_1_is_the_mean_of_each_source(case: tuple) -> None:
    sources, uids, values, _ = case
    out = validation_metrics(sources, uids, {"reward": values})
    for source in set(sources):
        mine = [v for s, v in zip(sources, values, strict=True) if s == source]
        assert out[f"val-core/{source}/reward/mean@1"] == pytest.approx(np.mean(mine))
    assert all(name.endswith("/mean@1") for name in out), "no std, best or worst at N=1"


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_best_at_n_mean_at_n_worst_at_n_are_ordered(data: st.DataObject) -> None:
    n = data.draw(st.integers(2, 9))
    sources, uids, values, preds = data.draw(validations(n=n))
    out = validation_metrics(sources, uids, {"reward": values}, preds)
    for source in set(sources):
        head = f"val-core/{source}/reward"
        best, mean = out[f"{head}/best@{n}/mean"], out[f"{head}/mean@{n}"]
        worst = out[f"val-aux/{source}/reward/worst@{n}/mean"]
        assert best + 1e-12 >= mean >= worst - 1e-12
        assert min(values) - 1e-12 <= worst and best <= max(values) + 1e-12
        assert worst - 1e-12 <= out[f"{head}/maj@{n}/mean"] <= best + 1e-12
        for k in bootstrap_sizes(n)[:-1]:  # smaller subsets: aux figures
            assert f"val-aux/{source}/reward/best@{k}/mean" in out
            assert f"val-aux/{source}/reward/maj@{k}/std" in out


def test_bootstrap_sizes_are_verls_powers_of_two() -> None:
    assert bootstrap_sizes(1) == []
    assert bootstrap_sizes(2) == [2]
    assert bootstrap_sizes(5) == [2, 4, 5]
    assert bootstrap_sizes(8) == [2, 4, 8]
    assert bootstrap_sizes(16) == [2, 4, 8, 16]


def test_best_and_worst_are_verls_bootstrap_with_its_seed() -> None:
    values = [0.0, 0.25, 1.0]
    out = validation_metrics(["s"] * 3, ["p"] * 3, {"reward": values})
    for k in (2, 3):
        np.random.seed(42)  # verl reseeds the global generator for every figure
        rows = np.asarray(values)[np.random.choice(3, size=(1000, k), replace=True)]
        tail = f"s/reward/best@{k}/mean"
        best = out.get(f"val-core/{tail}", out.get(f"val-aux/{tail}"))
        assert best == pytest.approx(rows.max(axis=1).mean(), abs=1e-15)
        assert out[f"val-aux/s/reward/worst@{k}/std"] == pytest.approx(rows.min(axis=1).std())
    assert out["val-aux/s/reward/std@3"] == pytest.approx(np.std(values))


def test_majority_takes_the_value_of_the_most_frequent_prediction() -> None:
    # Four responses, three predicting "7" (all right), one "9" (wrong): any draw of 4 with
    # a majority of "7" scores 1; verl's tie goes to the prediction drawn first.
    out = validation_metrics(["s"] * 4, [0] * 4, {"reward": [1.0, 1.0, 1.0, 0.0]},
                             ["7", "7", "7", "9"])
    np.random.seed(42)
    rows = np.random.choice(4, size=(1000, 4), replace=True)
    expected = []
    for row in rows:
        preds = ["7" if i < 3 else "9" for i in row]
        counts = {p: preds.count(p) for p in dict.fromkeys(preds)}
        expected.append(1.0 if max(counts, key=counts.__getitem__) == "7" else 0.0)
    assert out["val-core/s/reward/maj@4/mean"] == pytest.approx(np.mean(expected))
    assert out["val-core/s/reward/maj@4/mean"] > out["val-core/s/reward/mean@4"]
    same = validation_metrics(["s"] * 3, [0] * 3, {"reward": [0.5] * 3}, ["x"] * 3)
    assert same["val-core/s/reward/maj@3/mean"] == 0.5
    assert "val-core/s/reward/maj@3/mean" not in validation_metrics(
        ["s"] * 3, [0] * 3, {"reward": [0.5] * 3})


def test_names_follow_verls_core_and_aux_rule() -> None:
    sources = ["gsm8k"] * 4 + ["math"] * 4
    uids = [0, 0, 1, 1, 2, 2, 3, 3]
    out = validation_metrics(sources, uids, {"reward": [1, 0, 1, 1, 0, 0, 1, 0],
                                             "exact": [1, 0, 1, 1, 0, 0, 1, 0]})
    core = {k for k in out if k.startswith("val-core/")}
    assert core == {f"val-core/{s}/reward/{f}" for s in ("gsm8k", "math")
                    for f in ("mean@2", "best@2/mean", "best@2/std")}
    assert "val-aux/gsm8k/reward/std@2" in out and "val-aux/math/reward/worst@2/mean" in out
    assert "val-aux/gsm8k/exact/mean@2" in out, "an extra key is a variable of its own"
    assert out["val-core/gsm8k/reward/mean@2"] == 0.75
    assert out["val-core/math/reward/mean@2"] == 0.25
    # A reward function that returns `acc` makes acc the core variable (verl's rule).
    with_acc = validation_metrics(["s"] * 2, [0, 1], {"reward": [0.2, 0.4], "acc": [0, 1]})
    assert with_acc == {"val-aux/s/reward/mean@1": pytest.approx(0.3),
                        "val-core/s/acc/mean@1": 0.5}


def test_prompts_with_different_response_counts_average_per_figure() -> None:
    out = validation_metrics(["s"] * 3, ["a", "a", "b"], {"reward": [1.0, 0.0, 1.0]})
    # mean@2 over prompt a only, mean@1 over prompt b only; the core N is the largest.
    assert out["val-core/s/reward/mean@2"] == 0.5
    assert out["val-aux/s/reward/mean@1"] == 1.0


def test_lengths_must_agree() -> None:
    with pytest.raises(ValueError, match="reward"):
        validation_metrics(["s"] * 2, [0, 1], {"reward": [1.0]})
    with pytest.raises(ValueError, match="preds"):
        validation_metrics(["s"] * 2, [0, 1], {"reward": [1.0, 0.0]}, ["a"])
