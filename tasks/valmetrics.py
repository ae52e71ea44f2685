"""verl's validation metrics, computed as verl's ``process_validation_metrics`` and its
trainer's ``_val_metrics_update`` compute them (pure: numpy only).

Samples are grouped by data source, then by prompt (``uid``: every response of one prompt
shares it). For each numeric variable (``reward``, and each extra key a reward function
returns) and each prompt with ``N`` responses:

- ``mean@N`` and, for ``N > 1``, ``std@N`` (population std, numpy's default);
- for ``N > 1`` and each ``k`` in verl's sizes (2, 4, 8, ... below ``N``, then ``N``):
  ``best@k/mean``, ``best@k/std``, ``worst@k/mean``, ``worst@k/std``: the mean and std of the
  max (min) over 1000 bootstrap draws of ``k`` responses with replacement, drawn with
  ``seed`` exactly as verl draws them (the legacy numpy generator seeded anew per figure);
- with predictions (``preds``), ``maj@k/mean`` and ``maj@k/std``: the value of the first
  response carrying the most frequent prediction in each draw (ties: the prediction seen
  first in the draw).

Each figure is then averaged over the prompts of its data source and named
``{section}/{data_source}/{variable}/{figure}``; ``section`` is ``val-core`` for the core
variable (``acc`` when a reward function returns it, else ``reward``) and its ``mean``,
``maj`` and ``best`` figures at the largest ``N``, ``val-aux`` for everything else.

>>> validation_metrics(["a", "a"], [0, 1], {"reward": [1.0, 0.0]}, None)
{'val-core/a/reward/mean@1': 0.5}
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

__all__ = ["N_BOOTSTRAP", "bootstrap_sizes", "core_name", "validation_metrics"]

N_BOOTSTRAP = 1000
"""Bootstrap draws per figure (verl's ``n_bootstrap``)."""


def bootstrap_sizes(n: int) -> list[int]:
    """verl's subset sizes for ``n`` responses: powers of two from 2 below ``n``, then ``n``
    (none for ``n <= 1``)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


def _draws(n: int, k: int, seed: int) -> np.ndarray:
    """The bootstrap indices [N_BOOTSTRAP, k] verl draws (np.random.seed(seed) then
    np.random.choice): the same stream from a private RandomState, no global state touched."""
    return np.random.RandomState(seed).choice(n, size=(N_BOOTSTRAP, k), replace=True)


def _majority(values: np.ndarray, preds: Sequence[str], rows: np.ndarray) -> np.ndarray:
    """Per draw, the value of the first response with the most frequent prediction."""
    out = np.empty(len(rows), dtype=np.float64)
    for r, row in enumerate(rows):
        counts: dict[str, int] = {}
        first: dict[str, float] = {}
        for i in row:
            p = preds[i]
            counts[p] = counts.get(p, 0) + 1
            first.setdefault(p, float(values[i]))
        out[r] = first[max(counts, key=counts.__getitem__)]
    return out


def _prompt_figures(values: np.ndarray, preds: Sequence[str] | None,
                    seed: int) -> dict[str, float]:
    """Every figure of one variable over one prompt's responses."""
    n = len(values)
    out = {f"mean@{n}": float(np.mean(values))}
    if n <= 1:
        return out
    out[f"std@{n}"] = float(np.std(values))
    for k in bootstrap_sizes(n):
        rows = _draws(n, k, seed)
        picked = values[rows]
        for name, stat in (("best", picked.max(axis=1)), ("worst", picked.min(axis=1))):
            out[f"{name}@{k}/mean"] = float(np.mean(stat))
            out[f"{name}@{k}/std"] = float(np.std(stat))
        if preds is not None:
            maj = _majority(values, preds, rows)
            out[f"maj@{k}/mean"] = float(np.mean(maj))
            out[f"maj@{k}/std"] = float(np.std(maj))
    return out


def core_name(variables: Sequence[str], variable: str, figure: str, n_max: int) -> str:
    """``val-core`` or ``val-aux`` for ``figure`` of ``variable`` (verl's rule: the core
    variable's mean/maj/best figures at the largest N are core)."""
    core_var = "acc" if "acc" in variables else "reward"
    core = (variable == core_var and figure.startswith(("mean", "maj", "best"))
            and f"@{n_max}" in figure)
    return "val-core" if core else "val-aux"


def _n_of(figure: str) -> int:
    return int(figure.split("@")[-1].split("/")[0])


def _group(data_sources: Sequence[str], uids: Sequence[Hashable]
           ) -> dict[str, dict[Hashable, list[int]]]:
    """Sample indices by data source, then by prompt, in first-seen order."""
    groups: dict[str, dict[Hashable, list[int]]] = {}
    for i, (source, uid) in enumerate(zip(data_sources, uids, strict=True)):
        groups.setdefault(source, {}).setdefault(uid, []).append(i)
    return groups


def validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[Hashable],
    variables: dict[str, Sequence[float]],
    preds: Sequence[str] | None = None,
    seed: int = 42,
) -> dict[str, float]:
    """verl's validation metrics of one validation (see the module docstring): one entry per
    sample in ``data_sources``, ``uids`` and each of ``variables``' lists (and ``preds``)."""
    n = len(data_sources)
    for name, vals in variables.items():
        if len(vals) != n:
            raise ValueError(f"variable {name!r} has {len(vals)} values for {n} samples")
    if preds is not None and len(preds) != n:
        raise ValueError(f"preds has {len(preds)} values for {n} samples")
    arrays = {name: np.asarray(vals, dtype=np.float64) for name, vals in variables.items()}
    metrics: dict[str, float] = {}
    for source, prompts in _group(data_sources, uids).items():
        for name, values in arrays.items():
            per_figure: dict[str, list[float]] = {}
            for idx in prompts.values():
                p = None if preds is None else [preds[i] for i in idx]
                for figure, value in _prompt_figures(values[idx], p, seed).items():
                    per_figure.setdefault(figure, []).append(value)
            n_max = max(_n_of(f) for f in per_figure)
            for figure, vals in per_figure.items():
                section = core_name(list(variables), name, figure, n_max)
                metrics[f"{section}/{source}/{name}/{figure}"] = float(np.mean(vals))
    return metrics
