"""verl's rejection sampling of rollouts (``algorithm.rollout_correction.rollout_rs`` ->
``trainer.rollout_rs``): the options and bounds read as verl reads them
(runconfig.rejection), the mask as verl's ``compute_rollout_rejection_mask`` makes it
(trainer.grpo.rejection_mask), and a step that trains only the kept tokens
(trainer.update), with the same gradient in micro-batches as whole."""

from __future__ import annotations

import math

import pytest
import torch

from runconfig import TrainerConfig
from runconfig.rejection import RejectionError, RejectionRule, rejection_rules
from tests.test_microbatch import _groups, _run
from trainer.grpo import rejection_mask


def test_options_and_bounds_read_as_verl_reads_them() -> None:
    (rule,) = rejection_rules("seq_mean_k1", "0.99_1.001")  # verl's _mis script
    assert rule == RejectionRule("seq_mean_k1", "seq_mean", "k1", math.log(0.99),
                                 math.log(1.001))
    (rule,) = rejection_rules("token_k1", 2.0)  # one bound: the lower is its inverse
    assert (rule.lower, rule.upper) == pytest.approx((math.log(0.5), math.log(2.0)))
    rules = rejection_rules("token_k2, seq_max_k3,token_k2", "0.5,3")  # duplicates dropped
    assert [(r.option, r.lower, r.upper) for r in rules] == [("token_k2", None, 0.5),
                                                            ("seq_max_k3", None, 3.0)]
    assert rejection_rules(None, "2") == () and rejection_rules(" ", None) == ()
    # YAML (and Python) read 0.3_3 as the number 0.33: an upper bound below its inverse.
    with pytest.raises(RejectionError, match="write lower_upper with a decimal point"):
        rejection_rules("seq_mean_k1", 0.33)
    for options, threshold, key in [
        ("seq_max_k1", 2.0, "rollout_rs"),  # verl has no max of k1
        ("token_k1", None, "rollout_rs_threshold"),
        ("token_k1,token_k2", "1,2,3", "rollout_rs_threshold"),
        ("token_k1", "2_1", "rollout_rs_threshold"),  # lower above upper
        ("token_k2", "0.1_2", "rollout_rs_threshold"),  # k2/k3 take one bound
        ("token_k3", "-1", "rollout_rs_threshold"),
        ("token_k3", "x", "rollout_rs_threshold"),
    ]:
        with pytest.raises(RejectionError) as err:
            rejection_rules(options, threshold)
        assert err.value.key == key, (options, threshold)


def test_the_mask_of_each_level() -> None:
    # r = log pi_old - log pi_rollout per token; row 1 has one padding token.
    r = torch.tensor([[0.0, 0.5, -0.5], [1.0, 0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old, rollout = r, torch.zeros_like(r)

    def keep(options: str, threshold: str) -> list[list[float]]:
        rules = rejection_rules(options, threshold)
        return rejection_mask(old, rollout, mask, rules).tolist()

    # token k1 = -r within [log 0.7, log 1.5] = [-0.357, 0.405]: -0.5, 0.5 and -1.0 are out.
    assert keep("token_k1", "0.7_1.5") == [[1, 0, 0], [0, 1, 0]]
    # token k2 = r^2/2 <= 0.1: |r| <= 0.447.
    assert keep("token_k2", "0.1") == [[1, 0, 0], [0, 1, 0]]
    # seq_sum k1: row 0 sums to 0, row 1 to -1.1 (padding left out): bounds [-0.5, 0.5].
    assert keep("seq_sum_k1", f"{math.exp(-0.5)}_{math.exp(0.5)}") == [[1, 1, 1], [0, 0, 0]]
    # seq_mean k3: row 0 mean of (e^r - 1 - r) = (0 + 0.1487 + 0.1065) / 3 = 0.0851; row 1
    # (0.7183 + 0.0052) / 2 = 0.3617.
    assert keep("seq_mean_k3", "0.1") == [[1, 1, 1], [0, 0, 0]]
    assert keep("seq_mean_k3", "0.05") == [[0, 0, 0], [0, 0, 0]]
    # seq_max k2: row 0 max 0.125, row 1 max 0.5 (the padding's 0 is not a token).
    assert keep("seq_max_k2", "0.2") == [[1, 1, 1], [0, 0, 0]]
    # Every option must keep a token.
    assert keep("token_k1,seq_max_k2", "0.7_1.5,0.2") == [[1, 0, 0], [0, 0, 0]]


def _rs(threshold: str, **kw: object) -> TrainerConfig:
    return TrainerConfig(ppo_mini_batch_size=2, entropy_coeff=0.0, weight_decay=0.0,
                         rollout_rs="seq_mean_k1", rollout_rs_threshold=threshold,
                         **kw)  # type: ignore[arg-type]


def test_a_step_trains_only_the_tokens_kept() -> None:
    groups = _groups(7, 4)
    _, grads, metrics = _run(_rs("0.8_1.25"), groups)  # every sequence rejected
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    params, grads, metrics = _run(_rs("0.3_3"), groups)  # some rejected
    assert 0.0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1.0
    assert any(torch.count_nonzero(g) for g in grads)
    # Keeping all by two different options is the same step (the mask is all ones).
    loose, _, kept_all = _run(_rs("0.01_100"), groups)
    same, _, _ = _run(TrainerConfig(ppo_mini_batch_size=2, entropy_coeff=0.0,
                                    weight_decay=0.0, rollout_rs="seq_max_k3",
                                    rollout_rs_threshold=1e30), groups)
    assert kept_all["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    for a, b in zip(loose, same, strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(loose, params, strict=True))


def test_each_option_s_rejections_are_figured_beside_the_combined_ones() -> None:
    """verl's ``rollout_rs_{option}_masked_fraction`` / ``_seq_masked_fraction`` per option,
    beside the combined fractions: an option that keeps everything says 0, the one that
    rejects says what it rejected, and the combined figure is the union of the two."""
    groups = _groups(7, 4)
    cfg = TrainerConfig(ppo_mini_batch_size=2, entropy_coeff=0.0, weight_decay=0.0,
                        rollout_rs="seq_max_k3,seq_mean_k1", rollout_rs_threshold="1e30,0.3_3")
    _, _, both = _run(cfg, groups)
    _, _, alone = _run(_rs("0.3_3"), groups)
    rc = "rollout_corr/rollout_rs"
    assert both[f"{rc}_seq_max_k3_masked_fraction"] == 0.0
    assert both[f"{rc}_seq_max_k3_seq_masked_fraction"] == 0.0
    for figure in ("masked_fraction", "seq_masked_fraction"):
        assert both[f"{rc}_seq_mean_k1_{figure}"] == alone[f"{rc}_{figure}"] > 0.0
        assert both[f"{rc}_{figure}"] == alone[f"{rc}_{figure}"]
        assert alone[f"{rc}_seq_mean_k1_{figure}"] == alone[f"{rc}_{figure}"]


@pytest.mark.parametrize("split", [{"micro_batch_size": 2}, {"micro_batch_size": 1},
                                   {"use_dynamic_bsz": True, "max_token_len": 9}])
def test_micro_batches_give_the_same_rejected_step(split: dict[str, object]) -> None:
    """The token mean is over the kept tokens of the whole mini-batch, whatever its split."""
    groups = _groups(7, 4)
    params0, grads0, m0 = _run(_rs("0.3_3", tis_cap=2.0), groups)
    params1, grads1, m1 = _run(_rs("0.3_3", tis_cap=2.0, **split), groups)
    for a, b in zip(grads0, grads1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(params0, params1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert m0["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(
        m1["rollout_corr/rollout_rs_masked_fraction"])


def test_the_importance_weights_applied_are_figured_as_verl_figures_them() -> None:
    """verl's token-level ``rollout_corr/rollout_is_*`` on weights worked by hand: tokens
    [0.5, 1.0, 4.0] in one sequence and [1.0] in another, truncated at 2."""
    from trainer.update import _is_weight_metrics

    raw = torch.tensor([0.5, 1.0, 4.0, 1.0])
    seq_raw = torch.tensor([5.5 / 3, 1.0])
    seq_applied = torch.tensor([3.5 / 3, 1.0])
    m = _is_weight_metrics(raw, seq_raw, seq_applied, cap=2.0)
    p = "rollout_corr/rollout_is"
    applied = [0.5, 1.0, 2.0, 1.0]
    mean = sum(applied) / 4
    assert m[f"{p}_mean"] == pytest.approx(mean)
    assert (m[f"{p}_max"], m[f"{p}_min"]) == (2.0, 0.5)
    assert m[f"{p}_ratio_fraction_high"] == 0.25  # 4.0 > 2
    assert m[f"{p}_ratio_fraction_low"] == 0.0  # none < 1/2
    assert m[f"{p}_std"] == pytest.approx((sum(a * a for a in applied) / 4 - mean ** 2) ** 0.5)
    norm = [a / mean for a in applied]
    assert m[f"{p}_eff_sample_size"] == pytest.approx(1 / (sum(x * x for x in norm) / 4),
                                                      rel=1e-6)
    assert m[f"{p}_seq_max_deviation"] == pytest.approx(3.5 / 3 - 1.0)
    assert (m[f"{p}_seq_fraction_high"], m[f"{p}_seq_fraction_low"]) == (0.0, 0.0)
    assert _is_weight_metrics(torch.zeros(0), torch.zeros(0), torch.zeros(0), 2.0) == {}


def test_a_step_figures_the_weights_of_its_stale_samples_only() -> None:
    cfg = TrainerConfig(ppo_mini_batch_size=2, entropy_coeff=0.0, weight_decay=0.0,
                        tis_cap=2.0)
    _, _, stale = _run(cfg, _groups(7, 4, stale=True))
    assert 0.0 < stale["rollout_corr/rollout_is_mean"] <= 2.0
    assert stale["rollout_corr/rollout_is_max"] <= 2.0
    _, _, fresh = _run(cfg, _groups(7, 4))  # on-policy: no weight applied, none figured
    assert not [k for k in fresh if k.startswith("rollout_corr/rollout_is")]


