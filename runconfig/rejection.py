"""verl's rejection sampling of rollouts (``algorithm.rollout_correction.rollout_rs``), read.

A rule keeps or rejects response tokens by how far the rollout's log-probs are from the
trainer's on the step's starting weights. Each option is a level and an estimator of that
gap per token, with ``r = log pi_old - log pi_rollout`` (clamped to +-20, as verl):

- ``k1 = -r``, ``k2 = r^2 / 2``, ``k3 = exp(r) - 1 - r``;
- ``token_kX``: each token on its own; ``seq_sum_kX``, ``seq_mean_kX``, ``seq_max_kX``
  (k2/k3 only): one figure per sequence, keeping or rejecting all its tokens.

A k1 option keeps values within ``[log lower, log upper]`` (``rollout_rs_threshold``
``"lower_upper"``, or one ``upper`` whose lower is ``1 / upper``); a k2/k3 option keeps
values ``<= upper``. Several options (``"token_k1,seq_mean_k3"``) must all keep a token;
``rollout_rs_threshold`` then gives one threshold for all, or one per option,
comma-separated. :func:`rejection_rules` reads both keys; the trainer applies them
(trainer.grpo.rejection_mask). Pure: no torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["OPTIONS", "RejectionError", "RejectionRule", "rejection_rules"]

OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
           "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""verl's ``rollout_rs`` options (``SUPPORTED_ROLLOUT_RS_OPTIONS``)."""


class RejectionError(ValueError):
    """What is wrong, and which of the two keys says it: ``rollout_rs`` (an option) or
    ``rollout_rs_threshold``."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class RejectionRule(NamedTuple):
    """One option: ``level`` (token, seq_sum, seq_mean, seq_max), ``estimator`` (k1, k2,
    k3), and the bounds a kept value lies within (k1: logs of verl's bounds; k2/k3: no
    lower bound)."""

    option: str
    level: str
    estimator: str
    lower: float | None
    upper: float


def rejection_rules(options: str | None, threshold: str | float | None
                    ) -> tuple[RejectionRule, ...]:
    """The rules of ``rollout_rs`` with ``rollout_rs_threshold`` (empty: no rejection).
    Raises :class:`RejectionError` saying what is wrong, in verl's terms."""
    if options is None or not str(options).strip():
        return ()
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    for name in names:
        if name not in OPTIONS:
            raise RejectionError("rollout_rs", f"unknown option {name!r}; verl's are "
                                               f"{', '.join(OPTIONS)}")
    if threshold is None:
        raise RejectionError("rollout_rs_threshold", f"{options!r} needs its thresholds")
    specs = ([str(threshold)] if isinstance(threshold, int | float)
             else [p.strip() for p in str(threshold).split(",") if p.strip()])
    if len(specs) not in (1, len(names)):
        raise RejectionError("rollout_rs_threshold", f"{len(specs)} thresholds for "
                             f"{len(names)} options: give one for all, or one per option")
    specs = specs * len(names) if len(specs) == 1 else specs
    return tuple(_rule(name, spec) for name, spec in zip(names, specs, strict=True))


def _rule(name: str, spec: str) -> RejectionRule:
    level, estimator = name.rsplit("_", 1)
    if estimator == "k1":
        lower_text, _, upper_text = spec.partition("_") if "_" in spec else ("", "", spec)
        upper = _positive(upper_text, name, spec)
        lower = _positive(lower_text, name, spec) if lower_text else 1.0 / upper
        if lower > upper:
            hint = ("" if "_" in spec else ": a one-number bound is the upper one, its inverse "
                    "the lower (YAML reads 0.3_3 as 0.33: write lower_upper with a decimal "
                    "point in each, 0.30_3.0)")
            raise RejectionError("rollout_rs_threshold",
                                 f"{name}: lower bound above the upper one in {spec!r}{hint}")
        return RejectionRule(name, level, estimator, math.log(lower), math.log(upper))
    if "_" in spec:
        raise RejectionError("rollout_rs_threshold", f"{name} takes one upper bound, not "
                                                     f"{spec!r}")
    return RejectionRule(name, level, estimator, None, _positive(spec, name, spec))


def _positive(text: str, name: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise RejectionError("rollout_rs_threshold", f"{name}: {spec!r} is not a number (or "
                                                     "lower_upper)") from None
    if not value > 0:
        raise RejectionError("rollout_rs_threshold", f"{name}: thresholds are positive, got "
                                                     f"{spec!r}")
    return value
